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

/// The replicas' latest shares of the key's request rate, each estimated from the throttle
/// windows every replica closes at every refusal in the fleet: added up they are the key's
/// rate, which the replicas then split by their demand.
#[derive(Debug, Default)]
pub(super) struct Shares {
    /// Per replica: its share (units/s), its demand (units it would send in the next second),
    /// when it was heard.
    latest: Vec<(String, f64, f64, Instant)>,
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
        self.latest.retain(|(r, _, _, at)| {
            r != replica && now.saturating_duration_since(*at) <= SHARE_ROUND
        });
        if self.latest.len() >= MAX_SHARES {
            self.latest.remove(0);
        }
        self.latest.push((replica.to_owned(), rate, demand, now));
        let mine = self.latest.iter().find(|(r, ..)| r == me)?.2;
        let rate: f64 = self.latest.iter().map(|s| s.1).sum();
        let demand: f64 = self.latest.iter().map(|s| s.2).sum();
        (demand > 0.0).then(|| rate * mine / demand)
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
}
