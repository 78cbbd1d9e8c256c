//! The replicas' shares of a key whose rate only its 429s show: each replica estimates its
//! share from the throttle windows every refusal in the fleet closes, publishes it with its
//! demand, and takes its part of their sum (see design.md, "How a fleet shares its quota").
//! Local, no I/O: the lease hands it what the fleet's channel brings.

use std::time::Duration;

use tokio::time::Instant;

/// Shares heard this long before the newest one are from an earlier round of 429s: their
/// replica closed no window in the newest (it was not asking for more), and what it uses is
/// not part of the rate the others split.
const SHARE_ROUND: Duration = Duration::from_secs(1);
/// At most this many replicas' shares are kept (the oldest go first).
const MAX_SHARES: usize = 1024;
/// A replica's pace is forgotten this long after it was heard (it may have left the key).
const PACE_KEEP: Duration = Duration::from_secs(10);
/// While its pace is capped by the 429s, a replica checks it and its demand this often...
pub(super) const PACE_CHECK: Duration = Duration::from_millis(100);
/// ...and publishes them when its demand moved this many times from the one published...
const DEMAND_MOVED: f64 = 2.0;
/// ...or its pace by this share of the one published.
const PACE_MOVED: f64 = 0.1;

/// What each replica last said of a key: a value (its share, or its pace; units/s), its demand,
/// and when it was heard; what was heard longer ago than the caller's `keep` is dropped.
#[derive(Debug, Default)]
struct Heard(Vec<(String, f64, f64, Instant)>);

impl Heard {
    /// `replica`'s value and demand, heard at `now`, replacing what it said before.
    fn hear(&mut self, replica: &str, value: f64, demand: f64, now: Instant, keep: Duration) {
        self.0
            .retain(|(r, .., at)| r != replica && now.saturating_duration_since(*at) <= keep);
        if self.0.len() >= MAX_SHARES {
            self.0.remove(0);
        }
        self.0.push((replica.to_owned(), value, demand, now));
    }

    /// `me`'s value and demand, if heard.
    fn of(&self, me: &str) -> Option<(f64, f64)> {
        self.0.iter().find(|(r, ..)| r == me).map(|h| (h.1, h.2))
    }

    /// The values and the demands added up.
    fn sums(&self) -> (f64, f64) {
        self.0
            .iter()
            .fold((0.0, 0.0), |(v, d), h| (v + h.1, d + h.2))
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// The replicas' latest shares of the key's request rate, each estimated from the throttle
/// windows every replica closes at every refusal in the fleet: added up they are the key's
/// rate, which the replicas then split by their demand.
#[derive(Debug, Default)]
pub(super) struct Shares {
    /// Per replica: its share (units/s), its demand (units it would send in the next second).
    latest: Heard,
}

impl Shares {
    /// `replica`'s share and demand, heard at `now`. Returns `me`'s part of the key's rate as
    /// the shares of this round add up, split by demand; `None` until `me` has a share in it.
    pub(super) fn heard(
        &mut self,
        replica: &str,
        rate: f64,
        demand: f64,
        me: &str,
        now: Instant,
    ) -> Option<f64> {
        self.latest.hear(replica, rate, demand, now, SHARE_ROUND);
        let (_, mine) = self.latest.of(me)?;
        let (rate, demand) = self.latest.sums();
        (demand > 0.0).then(|| rate * mine / demand)
    }
}

/// The paces of the replicas on a key whose rate only the 429s show, and their demands, as
/// each published them. Each replica's pace is its own AIMD on the 429s; added up they are
/// what the fleet sends, which is all it knows of the key's rate between 429s. Each replica
/// sends at its part of that sum split by demand, so the queues drain together: split by the
/// paces alone, the last queue of a herd to drain finished at its part of the key, a tenth of
/// the run after the others.
#[derive(Debug, Default)]
pub(super) struct Paces {
    /// Per replica: its pace (units/s), its demand.
    latest: Heard,
}

impl Paces {
    /// `replica`'s pace and demand, heard at `now`.
    pub(super) fn heard(&mut self, replica: &str, pace: f64, demand: f64, now: Instant) {
        self.latest.hear(replica, pace, demand, now, PACE_KEEP);
    }

    /// `me`'s part of the paces' sum split by demand, as a multiple of its own pace, all as
    /// published (its own as the channel echoed it); `None` until `me` and a peer are heard, or
    /// with no demand.
    pub(super) fn scale(&self, me: &str) -> Option<f64> {
        let (pace, demand) = self.latest.of(me)?;
        let (sum, wanted) = self.latest.sums();
        (self.latest.len() > 1 && wanted > 0.0 && pace > 0.0).then(|| sum * demand / wanted / pace)
    }
}

/// This replica's side of [`Paces`]: the pace and demand it published, and when it last
/// checked them against what it now has (its pace, its queue, what it sends when none waits).
#[derive(Debug, Default)]
pub(super) struct MyPace {
    /// The pace and demand published last.
    published: Option<(f64, f64)>,
    /// When they were last checked, and the answers counted by then.
    checked: Option<(Instant, u64)>,
}

impl MyPace {
    /// When the next check is due: while requests wait (`active`), or until an idle demand
    /// follows a busy one.
    pub(super) fn due(&self, active: bool, now: Instant) -> Option<Instant> {
        let busy = self.published.is_some_and(|(_, demand)| demand > 0.0);
        if !active && !busy {
            return None;
        }
        Some(self.checked.map_or(now, |(at, _)| at + PACE_CHECK))
    }

    /// What to publish at `now`, if anything moved far enough since the last: `pace` (`None`:
    /// not capped by the 429s, nothing to say) and the demand: the requests waiting
    /// (`queued`), or without a queue what was sent since the last check (`answers` counted
    /// now).
    pub(super) fn check(
        &mut self,
        now: Instant,
        pace: Option<f64>,
        queued: usize,
        answers: u64,
    ) -> Option<(f64, f64)> {
        let (at, counted) = self.checked.unwrap_or((now, answers));
        let dt = now.saturating_duration_since(at);
        if self.checked.is_some() && dt < PACE_CHECK {
            return None;
        }
        self.checked = Some((now, answers));
        let pace = pace?;
        let demand = if queued > 0 {
            queued as f64
        } else if dt.is_zero() {
            0.0
        } else {
            answers.saturating_sub(counted) as f64 / dt.as_secs_f64()
        };
        let moved = self.published.is_none_or(|(p, d)| {
            demand * DEMAND_MOVED < d
                || demand > d * DEMAND_MOVED
                || (pace - p).abs() > PACE_MOVED * p
        });
        if !moved {
            return None;
        }
        self.published = Some((pace, demand));
        Some((pace, demand))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn shares_add_up_to_the_keys_rate_and_split_by_demand() {
        let now = Instant::now();
        let mut shares = Shares::default();
        // Until this replica's own share is heard, nothing to split.
        assert_eq!(shares.heard("b", 9.0, 10.0, "a", now), None);
        // 9 + 3 = 12/s between them; "a" has three times the demand of "b".
        assert_eq!(shares.heard("a", 3.0, 30.0, "a", now), Some(9.0));
        // A newer share replaces a replica's older one.
        assert_eq!(shares.heard("b", 5.0, 10.0, "a", now), Some(6.0));
        // A share from an earlier round (its replica closed no window since) is left out: "b"'s is
        // over a second old when "c" is heard, and "a" splits with "c" alone.
        let later = now + Duration::from_millis(1500);
        assert_eq!(shares.heard("c", 4.0, 10.0, "a", later), None);
        assert_eq!(shares.heard("a", 4.0, 10.0, "a", later), Some(4.0));
        // The count is bounded.
        for i in 0..2 * MAX_SHARES {
            shares.heard(&i.to_string(), 1.0, 1.0, "a", later);
        }
        assert!(shares.latest.len() <= MAX_SHARES);
    }

    #[tokio::test(start_paused = true)]
    async fn paces_add_up_and_split_by_demand() {
        let now = Instant::now();
        let mut paces = Paces::default();
        paces.heard("a", 50.0, 100.0, now);
        assert_eq!(paces.scale("a"), None, "no peer heard");
        for (r, pace) in [("b", 60.0), ("c", 45.0), ("d", 45.0)] {
            paces.heard(r, pace, 100.0, now);
        }
        assert_eq!(paces.scale("x"), None, "not heard itself");
        // 200/s between them, equal demands: a fourth each, 50/s, its own pace.
        assert_eq!(paces.scale("a"), Some(1.0));
        assert_eq!(paces.scale("c"), Some(50.0 / 45.0));
        // "d" ran dry: its part goes to the three still queued.
        paces.heard("d", 45.0, 0.0, now);
        let part = paces.scale("a").unwrap() * 50.0;
        assert!((part - 200.0 / 3.0).abs() < 1e-9, "{part}");
        // A queue three times the others': three fifths.
        paces.heard("a", 50.0, 300.0, now);
        assert_eq!(paces.scale("a"), Some(120.0 / 50.0));
        // Every demand gone: none; peers long unheard are forgotten.
        for r in ["a", "b", "c"] {
            paces.heard(r, 50.0, 0.0, now);
        }
        assert_eq!(paces.scale("a"), None);
        let later = now + PACE_KEEP * 2;
        paces.heard("e", 20.0, 10.0, later);
        paces.heard("a", 20.0, 10.0, later);
        assert_eq!(paces.scale("a"), Some(1.0));
        assert_eq!(paces.latest.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pace_is_published_when_it_or_its_demand_moves() {
        let t0 = Instant::now();
        let mut mine = MyPace::default();
        assert_eq!(
            mine.due(false, t0),
            None,
            "an idle partition is never checked"
        );
        assert_eq!(mine.due(true, t0), Some(t0));
        // Not capped: nothing to say.
        assert_eq!(mine.check(t0, None, 100, 0), None);
        let t1 = t0 + PACE_CHECK;
        assert_eq!(mine.due(true, t0), Some(t1));
        assert_eq!(mine.check(t1, Some(50.0), 100, 3), Some((50.0, 100.0)));
        // Too soon; then a queue down by less than half, a pace up by less than a tenth.
        assert_eq!(mine.check(t1 + PACE_CHECK / 2, Some(50.0), 10, 5), None);
        let t2 = t1 + PACE_CHECK;
        assert_eq!(mine.check(t2, Some(54.0), 60, 8), None);
        // The pace up by a fifth; then the queue halved.
        let t3 = t2 + PACE_CHECK;
        assert_eq!(mine.check(t3, Some(60.0), 60, 13), Some((60.0, 60.0)));
        let t4 = t3 + PACE_CHECK;
        assert_eq!(mine.check(t4, Some(60.0), 29, 19), Some((60.0, 29.0)));
        // The queue ran dry and nothing was sent since: idle, then no more checks.
        let t5 = t4 + PACE_CHECK;
        assert_eq!(mine.check(t5, Some(60.0), 0, 19), Some((60.0, 0.0)));
        assert_eq!(mine.due(false, t5), None);
        // Requests again, sent without a queue (5 in 0.1 s): 50/s.
        let t6 = t5 + PACE_CHECK;
        assert_eq!(mine.due(true, t5), Some(t6));
        assert_eq!(mine.check(t6, Some(60.0), 0, 24), Some((60.0, 50.0)));
    }
}
