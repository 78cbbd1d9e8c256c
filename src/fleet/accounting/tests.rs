//! The accounting's tests, in virtual time.

use super::*;

#[tokio::test(start_paused = true)]
async fn a_grant_below_the_shared_level_is_usable_as_the_bucket_refills() {
    let now = Instant::now();
    // 10 units granted at level 4, refilling 2/s: 4 at once, then one every half second.
    let mut holding = Holding {
        shared: Some((2.0, 50.0)),
        ..Holding::default()
    };
    holding.grants.push_back(Grant {
        origin: now,
        offset: 4.0,
        rate: 2.0,
        total: 10.0,
        released: 0.0,
    });
    holding.release(now);
    assert_eq!(holding.available, 4.0);
    assert_eq!(
        holding.ready_at(5.0),
        Some(now + Duration::from_millis(500))
    );
    holding.release(now + Duration::from_secs(2));
    assert_eq!(holding.available, 8.0);
    holding.release(now + Duration::from_secs(60));
    assert_eq!(holding.available, 10.0, "never more than granted");
    assert_eq!(holding.held(), 10.0);
    assert_eq!(
        holding.ready_at(11.0),
        None,
        "beyond the grant: wait for another"
    );
    // A grant that queued behind others (level -6): nothing before 3 s.
    let mut queued = Holding::default();
    queued.grants.push_back(Grant {
        origin: now,
        offset: -6.0,
        rate: 2.0,
        total: 10.0,
        released: 0.0,
    });
    queued.release(now + Duration::from_millis(2999));
    assert!(queued.available < 1.0);
    assert_eq!(
        queued.ready_at(1.0),
        Some(now + Duration::from_millis(3500))
    );
}

/// A request larger than the shared burst takes what is usable and owes at most one burst:
/// the partition is not held for the whole of its cost at the shared rate.
#[tokio::test(start_paused = true)]
async fn a_huge_request_owes_the_lease_at_most_one_burst() {
    let now = Instant::now();
    let (rate, burst) = (100.0, 1_000.0);
    let mut s = Account::new([Some((10.0, 50.0)), Some((rate, burst))], now);
    for holding in &mut s.holdings {
        holding.available = holding.shared.unwrap().1;
    }
    assert!(matches!(s.try_take(1.0e9, now), Admission::Taken { .. }));
    let tokens = &s.holdings[TOKENS];
    assert!(
        tokens.available >= -burst,
        "owes {} tokens, more than the burst of {burst}",
        -tokens.available
    );
    // Granted again at the shared rate, the next request waits for the debt and its own
    // units: at most two bursts' worth of refill.
    s.holdings[TOKENS].grants.push_back(Grant {
        origin: now,
        offset: 0.0,
        rate,
        total: 2.0 * burst,
        released: 0.0,
    });
    let ready = s.holdings[TOKENS].ready_at(1.0).expect("within the grant");
    assert!(
        ready <= now + Duration::from_secs_f64(2.0 * burst / rate),
        "ready after {:?}",
        ready - now
    );
}

/// A request's tokens taken at its estimate are settled from what the upstream counted: the
/// unused part is usable again at once (within one burst), an overrun owed.
#[tokio::test(start_paused = true)]
async fn tokens_taken_at_the_estimate_are_settled_from_the_count() {
    let now = Instant::now();
    let (rate, burst) = (1_000.0, 10_000.0);
    let mut s = Account::new([None, Some((rate, burst))], now);
    s.holdings[TOKENS].available = 3_000.0;
    // Estimated at 2,500 (prompt plus max_tokens), counted 400.
    let taken = |a: Admission| match a {
        Admission::Taken { tokens, .. } => tokens,
        _ => panic!("not taken"),
    };
    assert_eq!(taken(s.try_take(2_500.0, now)), 2_500.0);
    assert_eq!(s.holdings[TOKENS].available, 500.0);
    s.settle(TOKENS, 2_500.0 - 400.0);
    assert_eq!(s.holdings[TOKENS].available, 2_600.0);
    assert_eq!(taken(s.try_take(2_500.0, now)), 2_500.0);
    // A request beyond the burst owes at most one: what it took is what settles.
    s.holdings[TOKENS].available = burst;
    assert_eq!(taken(s.try_take(1.0e9, now)), 2.0 * burst);
    // An overrun is owed, and neither side of a settlement goes past one burst.
    s.settle(TOKENS, -50_000.0);
    assert_eq!(s.holdings[TOKENS].available, -burst);
    s.settle(TOKENS, 50_000.0);
    assert_eq!(s.holdings[TOKENS].available, burst);
}

/// Redis lost the bucket a grant came from (a new epoch): the grant's units not yet due are
/// dropped, the usable ones kept; the same epoch keeps everything.
#[tokio::test(start_paused = true)]
async fn units_not_yet_due_from_a_lost_bucket_are_dropped() {
    let now = Instant::now();
    let mut holding = Holding {
        shared: Some((1.0, 5.0)),
        ..Holding::default()
    };
    holding.rebase("1:a", now);
    holding.grants.push_back(Grant {
        origin: now,
        offset: 2.0,
        rate: 1.0,
        total: 10.0,
        released: 0.0,
    });
    holding.rebase("1:a", now);
    assert_eq!(holding.held(), 10.0, "same bucket: all kept");
    holding.rebase("2:b", now);
    assert_eq!(holding.available, 2.0, "the two due at once are kept");
    assert_eq!(holding.held(), 2.0, "the eight not yet due are gone");
}

/// A shared burst that shrinks (a per-minute report taken for the bucket, found out by a 429)
/// leaves this replica at most its part of what the shared bucket has: the units it held were
/// granted from a bucket that was never there, and four replicas spending them met the
/// upstream's edge again within a round trip.
#[tokio::test(start_paused = true)]
async fn a_shrunk_burst_takes_back_what_its_larger_self_granted() {
    let now = Instant::now();
    let mut s = Account::new([None, None], now);
    let keys = ["r", "t", "p", "l"].map(String::from);
    let reply = |grant: f64, before: f64, burst: f64| Reply {
        kinds: [(grant, before, 200.0, burst), (0.0, 0.0, 0.0, 0.0)],
        epochs: ["1:a".to_owned(), "-".to_owned()],
        pause_ms: 0,
        live: 4,
    };
    let args = s.call_args(&keys, [None, None], false, false, now);
    // Granted 110 from a level of 11,000 in a bucket of 12,000: all usable at once.
    s.apply(&args, &reply(110.0, 11_000.0, 12_000.0), now);
    s.holdings[REQUESTS].release(now);
    assert_eq!(s.holdings[REQUESTS].available, 110.0);
    // A 429 taught the bucket is 50 and empty; Redis has 8 by the next call.
    let later = now + Duration::from_millis(40);
    let args = s.call_args(&keys, [None, None], false, false, later);
    s.apply(&args, &reply(0.0, 8.0, 50.0), later);
    assert_eq!(s.holdings[REQUESTS].available, 2.0, "a quarter of the 8");
    // A burst that stays or grows takes nothing back.
    s.holdings[REQUESTS].available = 30.0;
    s.apply(&args, &reply(0.0, 8.0, 50.0), later);
    assert_eq!(s.holdings[REQUESTS].available, 30.0);
}
