//! The lease script (`lease.lua`) as Rust sees it: what one call sends, what it answers, and
//! what it publishes on the fleet's channel.
//!
//! Each partition has four keys under one hash tag (so that one script may use them all on Redis
//! Cluster): its requests and tokens buckets, its shared pause and its live replicas. One call
//! carries this replica's id and heartbeat TTL, whether it is leaving, the pause and refusals of
//! its latest 429, then per bucket the units wanted and given back, the configured and the
//! learned limit, the fleet's channel, whether the replica fell back since its last answer, and
//! the epochs of the buckets the units given back came from. `lease.lua` documents each
//! argument by position; [`CallArgs::invocation`] must send them in that order.
//!
//! Everything here is the wire format only: what to ask for and what an answer means for the
//! units held is the accounting's (`accounting`), when to call is the lease task's (`lease`).

use std::time::Duration;

use tokio::time::Instant;

/// The lease script's source.
pub(super) const SCRIPT: &str = include_str!("lease.lua");

/// The arguments of one lease call.
pub(super) struct CallArgs {
    pub keys: [String; 4],
    pub resync: bool,
    pub leaving: bool,
    pub pause_ms: u64,
    pub refused: u8,
    /// The refusals are a bucket's edge: the script publishes them to the peers.
    pub edge: bool,
    /// The edge was the caller's first send after its pause ended: published with it.
    pub first: bool,
    /// This replica's estimate of its share of the key's rate, and its demand, to publish.
    pub estimate: Option<(f64, f64)>,
    /// This replica's pace (capped by the 429s) and its demand, to publish.
    pub pace: Option<(f64, f64)>,
    pub kinds: [KindArgs; 2],
}

pub(super) struct KindArgs {
    pub want: f64,
    pub give_back: f64,
    /// The epoch of the bucket the units given back came from.
    pub epoch: Option<String>,
    pub config: Option<(f64, f64)>,
    pub learned: Option<(f64, f64, Option<f64>)>,
    /// Units sent after the attempt whose report the learned level is.
    pub unseen: f64,
}

impl CallArgs {
    /// `script` called with these arguments, for `replica` of the fleet publishing on
    /// `channel`.
    pub(super) fn invocation<'a>(
        &self,
        script: &'a redis::Script,
        replica: &str,
        heartbeat_ttl: Duration,
        channel: &str,
    ) -> redis::ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys {
            invocation.key(key);
        }
        invocation
            .arg(replica)
            .arg(heartbeat_ttl.as_millis() as u64)
            .arg(if self.leaving { "1" } else { "0" })
            .arg(self.pause_ms)
            .arg(self.refused);
        for kind in &self.kinds {
            invocation
                .arg(kind.want)
                .arg(kind.give_back)
                .arg(kind.config.map_or(0.0, |c| c.0))
                .arg(kind.config.map_or(0.0, |c| c.1))
                .arg(kind.learned.map_or(0.0, |l| l.0))
                .arg(kind.learned.map_or(0.0, |l| l.1))
                .arg(kind.learned.and_then(|l| l.2).unwrap_or(-1.0));
        }
        invocation
            .arg(channel)
            .arg(if self.resync { "1" } else { "0" });
        for kind in &self.kinds {
            invocation.arg(kind.epoch.as_deref().unwrap_or("-"));
        }
        invocation.arg(if self.edge { "1" } else { "0" });
        invocation.arg(match self.estimate {
            Some((rate, demand)) => format!("{rate:.3} {demand:.3}"),
            None => "-".to_owned(),
        });
        for kind in &self.kinds {
            invocation.arg(kind.unseen);
        }
        invocation.arg(match self.pace {
            Some((pace, demand)) => format!("{pace:.3} {demand:.3}"),
            None => "-".to_owned(),
        });
        invocation.arg(if self.first { "1" } else { "0" });
        invocation
    }
}

/// The lease script's answer.
pub(super) struct Reply {
    /// Per bucket: granted, level before, rate, burst.
    pub kinds: [(f64, f64, f64, f64); 2],
    /// Per bucket: its epoch.
    pub epochs: [String; 2],
    pub pause_ms: u64,
    pub live: u64,
}

/// The answer in `r`, if it is one: per bucket four numbers and an epoch, then the pause left
/// and the live replicas.
pub(super) fn parse(r: &[String]) -> Option<Reply> {
    if r.len() != 12 {
        return None;
    }
    let n = |i: usize| r[i].parse::<f64>().ok();
    let kind = |b: usize| Some((n(b)?, n(b + 1)?, n(b + 2)?, n(b + 3)?));
    Some(Reply {
        kinds: [kind(0)?, kind(5)?],
        epochs: [r[4].clone(), r[9].clone()],
        pause_ms: n(10)?.max(0.0) as u64,
        live: n(11)?.max(1.0) as u64,
    })
}

/// A message the script published on the fleet's channel.
#[derive(Debug)]
pub(super) enum Message<'a> {
    /// "PAUSE-KEY pause MS": another replica's 429 paused the partition for `ms`.
    Pause { key: &'a str, ms: u64 },
    /// "PAUSE-KEY learned": a shared bucket now paces the partition: lease from it.
    Learned { key: &'a str },
    /// "PAUSE-KEY joined": a replica new to the partition called: the live count grew.
    Joined { key: &'a str },
    /// "PAUSE-KEY throttled BUCKETS REPLICA [first]": the upstream refused `replica` because a
    /// bucket was empty (`refused`: 1 requests, 2 tokens, 3 both); `first`: the refused attempt
    /// was the replica's first send after its pause ended.
    Throttled {
        key: &'a str,
        refused: u8,
        replica: &'a str,
        first: bool,
    },
    /// "PAUSE-KEY share RATE DEMAND REPLICA": `replica`'s estimate of its share of the key's
    /// request rate, and its demand (requests it would send in the next second).
    Share {
        key: &'a str,
        rate: f64,
        demand: f64,
        replica: &'a str,
    },
    /// "PAUSE-KEY pace PACE DEMAND REPLICA": `replica`'s pace, capped by the 429s, and its
    /// demand.
    Pace {
        key: &'a str,
        pace: f64,
        demand: f64,
        replica: &'a str,
    },
}

impl<'a> Message<'a> {
    /// The message in `text`, if it is one.
    pub(super) fn parse(text: &'a str) -> Option<Self> {
        let mut words = text.split(' ');
        let (Some(key), Some(what)) = (words.next(), words.next()) else {
            return None;
        };
        let number = |w: Option<&str>| {
            w?.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
        };
        match what {
            "pause" => Some(Self::Pause {
                key,
                ms: words.next()?.parse().ok()?,
            }),
            "learned" => words.next().is_none().then_some(Self::Learned { key }),
            "joined" => words.next().is_none().then_some(Self::Joined { key }),
            "throttled" => {
                let refused = words.next()?.parse().ok().filter(|r| (1..=3).contains(r))?;
                let replica = words.next()?;
                let first = match words.next() {
                    None => false,
                    Some("first") => true,
                    Some(_) => return None,
                };
                words.next().is_none().then_some(Self::Throttled {
                    key,
                    refused,
                    replica,
                    first,
                })
            }
            "share" => Some(Self::Share {
                key,
                rate: number(words.next())?,
                demand: number(words.next())?,
                replica: words.next()?,
            }),
            "pace" => Some(Self::Pace {
                key,
                pace: number(words.next())?,
                demand: number(words.next())?,
                replica: words.next()?,
            }),
            _ => None,
        }
    }
}

/// The end of a pause of `ms` milliseconds that Redis reported at `now`, capped as a local hint
/// is ([`MAX_HINT`](crate::provider::hints::MAX_HINT)): a peer's word is no better than the
/// upstream's, and a corrupt value must not overflow the clock or stop the partition for good.
pub(super) fn pause_end(now: Instant, ms: u64) -> Instant {
    now + Duration::from_millis(ms).min(crate::provider::hints::MAX_HINT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_or_are_refused() {
        let r: Vec<String> = [
            "10", "4.5", "20", "50", "7:a", "0", "0", "0", "0", "-", "1500", "4",
        ]
        .map(String::from)
        .to_vec();
        let reply = parse(&r).unwrap();
        assert_eq!(reply.kinds[0], (10.0, 4.5, 20.0, 50.0));
        assert_eq!(reply.epochs[0], "7:a");
        assert_eq!((reply.pause_ms, reply.live), (1500, 4));
        assert!(parse(&r[..11]).is_none());
        assert!(parse(&vec!["x".to_string(); 12]).is_none());
    }

    #[test]
    fn messages_parse_or_are_refused() {
        assert!(matches!(
            Message::parse("k pause 1500"),
            Some(Message::Pause { key: "k", ms: 1500 })
        ));
        assert!(matches!(
            Message::parse("k learned"),
            Some(Message::Learned { key: "k" })
        ));
        assert!(matches!(
            Message::parse("k joined"),
            Some(Message::Joined { key: "k" })
        ));
        assert!(Message::parse("k joined 2").is_none());
        assert!(matches!(
            Message::parse("k throttled 3 host:1"),
            Some(Message::Throttled {
                key: "k",
                refused: 3,
                replica: "host:1",
                first: false,
            })
        ));
        assert!(matches!(
            Message::parse("k throttled 1 host:1 first"),
            Some(Message::Throttled {
                refused: 1,
                first: true,
                ..
            })
        ));
        assert!(Message::parse("k throttled 1 host:1 later").is_none());
        assert!(matches!(
            Message::parse("k share 4.5 110 host:1"),
            Some(Message::Share {
                key: "k",
                demand: 110.0,
                replica: "host:1",
                ..
            })
        ));
        assert!(matches!(
            Message::parse("k pace 52.5 0 host:1"),
            Some(Message::Pace {
                key: "k",
                demand: 0.0,
                replica: "host:1",
                ..
            })
        ));
        for bad in [
            "k pace 1 -2 r",
            "k pace 3 r",
            "k throttled 0 r",
            "k throttled 4 r",
            "k throttled 1",
            "k throttled x r",
            "k share NaN 1 r",
            "k share -1 1 r",
            "k share 1 1",
            "k pause x",
        ] {
            assert!(Message::parse(bad).is_none(), "{bad}");
        }
    }
}
