//! Which requests get a `request` log line (`access_log`, `slow_request`): decided per request
//! from numbers the request path has anyway, with a few comparisons and no lock, before anything
//! is formatted. A line costs about 4 µs of formatting on the request path (the writing is
//! done by the log thread, see `cli::init_logging`), so by default only the notable ones get it.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use crate::config::{AccessLog, Config};

/// Held for less than this, a request is not logged as held: a gate's slow path that did not
/// wait (a bucket with tokens, an uncontended turn) takes microseconds, a thread descheduled on
/// a busy machine can stall a few milliseconds anywhere, and next to an LLM call's seconds a few
/// milliseconds of pacing are not worth a line (`corral_queue_wait_seconds` and
/// `corral_rate_limit_wait_seconds` count every wait).
pub const HELD_MIN: Duration = Duration::from_millis(10);

/// Why a request was logged: its `why` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Answered with a status of 400 or above, corral's own answers (`x-corral-error`) included.
    Error,
    /// Sent upstream more than once.
    Retried,
    /// Held by corral for [`HELD_MIN`] or more before its first attempt.
    Held,
    /// Its response head took longer than `slow_request`.
    Slow,
    /// None of these; logged because `access_log = "all"`.
    All,
}

impl Why {
    pub fn label(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Retried => "retried",
            Self::Held => "held",
            Self::Slow => "slow",
            Self::All => "all",
        }
    }
}

/// What the decision looks at, all known when the response head is ready.
#[derive(Debug, Clone, Copy)]
pub struct Exchange {
    pub status: u16,
    /// corral answered itself (a `ProxyError`; its statuses are all 400 or above anyway).
    pub corral_error: bool,
    pub attempts: u32,
    /// See [`RequestCtx::held_until`](crate::forward::RequestCtx::held_until).
    pub held: Duration,
    /// From arrival to the response head.
    pub duration: Duration,
}

/// Whether `exchange` is logged under `mode` and `slow`, and why: the first of error, retried,
/// held, slow that applies (under `all` too, so `why` reads the same in both modes), else `all`
/// under `all`.
pub fn why(mode: AccessLog, slow: Duration, exchange: &Exchange) -> Option<Why> {
    if mode == AccessLog::Off {
        return None;
    }
    let why = if exchange.status >= 400 || exchange.corral_error {
        Why::Error
    } else if exchange.attempts > 1 {
        Why::Retried
    } else if exchange.held >= HELD_MIN {
        Why::Held
    } else if exchange.duration > slow {
        Why::Slow
    } else if mode == AccessLog::All {
        Why::All
    } else {
        return None;
    };
    Some(why)
}

/// The `access_log` and `slow_request` in force, read per request without a lock and replaced
/// whole by a reload (a request that reads between the two stores sees one old and one new:
/// harmless).
#[derive(Debug)]
pub struct Policy {
    mode: AtomicU8,
    slow_nanos: AtomicU64,
}

impl Policy {
    pub fn new(config: &Config) -> Self {
        let policy = Self {
            mode: AtomicU8::new(0),
            slow_nanos: AtomicU64::new(0),
        };
        policy.set(config);
        policy
    }

    /// Apply `config`'s settings (at start and on reload).
    pub fn set(&self, config: &Config) {
        let mode = match config.access_log {
            AccessLog::Notable => 0,
            AccessLog::All => 1,
            AccessLog::Off => 2,
        };
        self.mode.store(mode, Ordering::Relaxed);
        // At most a year (`MAX_DURATION`): fits in u64 nanoseconds 500 times over.
        let slow = config.slow_request.0.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.slow_nanos.store(slow, Ordering::Relaxed);
    }

    fn mode(&self) -> AccessLog {
        match self.mode.load(Ordering::Relaxed) {
            0 => AccessLog::Notable,
            1 => AccessLog::All,
            _ => AccessLog::Off,
        }
    }

    /// Whether `exchange` gets a line, and why.
    pub fn why(&self, exchange: &Exchange) -> Option<Why> {
        let slow = Duration::from_nanos(self.slow_nanos.load(Ordering::Relaxed));
        why(self.mode(), slow, exchange)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOW: Duration = Duration::from_secs(30);

    /// A plain 200: one attempt, not held, well within `slow_request`.
    fn plain() -> Exchange {
        Exchange {
            status: 200,
            corral_error: false,
            attempts: 1,
            held: Duration::from_micros(40),
            duration: Duration::from_secs(4),
        }
    }

    fn notable(exchange: Exchange) -> Option<&'static str> {
        why(AccessLog::Notable, SLOW, &exchange).map(Why::label)
    }

    #[test]
    fn a_plain_success_is_not_logged_by_default() {
        assert_eq!(notable(plain()), None);
        let streamed = Exchange {
            status: 204,
            duration: SLOW,
            held: HELD_MIN - Duration::from_micros(1),
            ..plain()
        };
        assert_eq!(notable(streamed), None, "at the thresholds, not past them");
        let redirect = Exchange {
            status: 399,
            ..plain()
        };
        assert_eq!(notable(redirect), None);
    }

    #[test]
    fn each_reason_is_logged_by_default() {
        let cases = [
            (
                Exchange {
                    status: 500,
                    ..plain()
                },
                "error",
            ),
            (
                Exchange {
                    status: 429,
                    ..plain()
                },
                "error",
            ),
            (
                Exchange {
                    status: 400,
                    ..plain()
                },
                "error",
            ),
            (
                Exchange {
                    corral_error: true,
                    ..plain()
                },
                "error",
            ),
            (
                Exchange {
                    attempts: 2,
                    ..plain()
                },
                "retried",
            ),
            (
                Exchange {
                    held: HELD_MIN,
                    ..plain()
                },
                "held",
            ),
            (
                Exchange {
                    duration: SLOW + Duration::from_millis(1),
                    ..plain()
                },
                "slow",
            ),
        ];
        for (exchange, want) in cases {
            assert_eq!(notable(exchange), Some(want), "{exchange:?}");
        }
    }

    #[test]
    fn the_first_reason_names_the_line() {
        let everything = Exchange {
            status: 502,
            corral_error: true,
            attempts: 7,
            held: Duration::from_secs(3),
            duration: Duration::from_secs(90),
        };
        assert_eq!(notable(everything), Some("error"));
        let retried_held_slow = Exchange {
            status: 200,
            corral_error: false,
            ..everything
        };
        assert_eq!(notable(retried_held_slow), Some("retried"));
        let held_slow = Exchange {
            attempts: 1,
            ..retried_held_slow
        };
        assert_eq!(notable(held_slow), Some("held"));
        // A request that never made an attempt (refused or given up while held) is an error.
        let never_sent = Exchange {
            status: 429,
            corral_error: true,
            attempts: 0,
            ..held_slow
        };
        assert_eq!(notable(never_sent), Some("error"));
    }

    #[test]
    fn all_logs_everything_and_names_the_reason_when_there_is_one() {
        let all = |exchange| why(AccessLog::All, SLOW, &exchange).map(Why::label);
        assert_eq!(all(plain()), Some("all"));
        let failed = Exchange {
            status: 503,
            ..plain()
        };
        assert_eq!(all(failed), Some("error"));
    }

    #[test]
    fn off_logs_nothing() {
        let failed = Exchange {
            status: 500,
            corral_error: true,
            attempts: 3,
            held: Duration::from_secs(1),
            duration: Duration::from_secs(60),
        };
        for exchange in [plain(), failed] {
            assert_eq!(why(AccessLog::Off, SLOW, &exchange), None);
        }
    }

    #[test]
    fn the_policy_follows_the_config_it_was_last_given() {
        let mut config = Config::default();
        let policy = Policy::new(&config);
        let slowish = Exchange {
            duration: Duration::from_secs(10),
            ..plain()
        };
        assert_eq!(policy.why(&plain()), None);
        assert_eq!(policy.why(&slowish), None);
        config.slow_request = crate::config::HumanDuration::from_secs(5);
        policy.set(&config);
        assert_eq!(policy.why(&slowish), Some(Why::Slow));
        config.access_log = AccessLog::All;
        policy.set(&config);
        assert_eq!(policy.why(&plain()), Some(Why::All));
        config.access_log = AccessLog::Off;
        policy.set(&config);
        assert_eq!(policy.why(&slowish), None);
    }
}
