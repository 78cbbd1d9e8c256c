//! A pool of credentials for one upstream (`keys = [...]`): each key has its own partition
//! (buckets, learned pacers, 429 pause, and with `[fleet]` its own shared buckets), one per
//! model too when the upstream's `partition` includes the model (made in the upstream's map of
//! partitions, keyed by the key's header value and the model), a request goes to the key with
//! the most headroom for its model, and a key the upstream refuses for good (401, 403,
//! a permanent 429) is set aside for `key_cooldown`, logged and counted, then tried again.
//!
//! Headroom, in order: not paused by a 429, then the fewest requests in flight or waiting on the
//! key's buckets; ties go round in turn, so an idle pool spreads its requests evenly. A request
//! refused for good by one key moves to the next key that is not set aside (each key at most
//! once per request); with none left, the refusal goes to the client as it came. A second key
//! refusing the same request alike (a 401 after a 401, a 403 after a 403) blames the request (a
//! model or region the account may not use, a bad `OpenAI-Organization`): that refusal goes to
//! the client and neither key stays aside.
//!
//! A key is never shown: logs, `/status` and metrics name it by its place in the list and a
//! fingerprint (a hash of the key, 8 hex digits).

use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue};
use tokio::time::Instant;

use super::partition::Partition;
use crate::client::Handshakes;
use crate::config::{HeaderMode, UpstreamConfig, KEY_PLACEHOLDER};
use crate::fleet::Fleet;
use crate::sync::SetAside;

/// One credential of the pool.
pub struct PoolKey {
    /// Its place in `keys`, from 1, and its fingerprint: how logs and `/status` name it.
    pub number: usize,
    pub fingerprint: String,
    /// The header value it makes (marked sensitive: hyper never logs it).
    value: HeaderValue,
    pub partition: Arc<Partition>,
    /// Requests sent with this key that have not been answered yet.
    in_flight: AtomicUsize,
    /// Set aside until then, and why (`401`, `403`, `quota`).
    aside: SetAside,
}

impl PoolKey {
    fn aside_until(&self, now: Instant) -> Option<(Instant, &'static str)> {
        self.aside.until(now)
    }

    /// Fewer is more headroom: paused keys last, then by requests in flight or waiting, as
    /// `partition` (the key's, or its partition for the request's model, if made) shows.
    fn load(&self, partition: Option<&Partition>, now: Instant) -> (bool, usize) {
        let (paused, waiting) = partition.map_or((false, 0), |p| (p.is_paused(now), p.waiting()));
        (paused, self.in_flight.load(Ordering::Relaxed) + waiting)
    }

    /// The header value this key goes upstream as: what names its partitions per model.
    pub fn credential(&self) -> &[u8] {
        self.value.as_bytes()
    }
}

/// Counts a request in flight on its key until dropped (answered, or the client left).
pub struct InFlight(Arc<PoolKey>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The keys of one upstream and the header they go in.
pub struct Pool {
    header: HeaderName,
    /// `if_absent`: a client's own credential in `header` wins over the pool.
    mode: HeaderMode,
    keys: Vec<Arc<PoolKey>>,
    /// Where the next search for the least loaded key starts: ties go round in turn.
    next: AtomicUsize,
    cooldown: Duration,
}

impl Pool {
    /// The pool `config.keys` describes, or `None` without keys. Validation has checked that
    /// exactly one header template holds the placeholder and that every key fills it validly.
    pub fn new(
        config: &UpstreamConfig,
        fleet: Option<&Arc<Fleet>>,
        handshakes: &Arc<Handshakes>,
    ) -> Option<Self> {
        if config.keys.is_empty() {
            return None;
        }
        let (name, template) = config
            .headers
            .iter()
            .find(|(_, v)| v.0.contains(KEY_PLACEHOLDER))?;
        let header = HeaderName::from_bytes(name.as_bytes()).ok()?;
        let keys = config
            .keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let mut value =
                    HeaderValue::from_str(&template.0.replace(KEY_PLACEHOLDER, &key.0)).ok()?;
                value.set_sensitive(true);
                let fleet = fleet.map(|f| (f, Some(key.0.as_bytes())));
                Some(Arc::new(PoolKey {
                    number: i + 1,
                    fingerprint: fingerprint(&key.0),
                    value,
                    partition: Arc::new(Partition::new(config, fleet).measured(handshakes)),
                    in_flight: AtomicUsize::new(0),
                    aside: SetAside::default(),
                }))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            header,
            mode: config.header_mode,
            keys,
            next: AtomicUsize::new(0),
            cooldown: config.key_cooldown.0,
        })
    }

    /// Whether this request uses the pool: not when the client brought its own credential in
    /// the pool's header under `header_mode = "if_absent"`.
    pub fn applies(&self, headers: &http::HeaderMap) -> bool {
        self.mode == HeaderMode::Always || !headers.contains_key(&self.header)
    }

    /// How many keys (never zero: a pool is made only from keys).
    /// Take on `old`'s pauses and cool-downs, key by key (matched by fingerprint): a reload
    /// rebuilt the upstream.
    pub fn carry_from(&self, old: &Pool) {
        let now = Instant::now();
        for key in &self.keys {
            let Some(was) = old.keys.iter().find(|k| k.fingerprint == key.fingerprint) else {
                continue;
            };
            key.partition.carry_pause(&was.partition);
            if let Some((until, why)) = was.aside.until(now) {
                key.aside.set(until, why);
            }
        }
    }

    pub fn keys(&self) -> usize {
        self.keys.len()
    }

    /// The key with the most headroom among those neither set aside nor in `tried` (a bit per
    /// key: at most [`crate::config::MAX_KEYS`] keys), judged by the partition `partition_of`
    /// gives for it (`None`: none yet, all headroom); ties in turn. With every untried key set
    /// aside, the one whose cool-down ends first (it may have recovered); `None` once every key
    /// has been tried.
    pub fn choose(
        &self,
        tried: u64,
        now: Instant,
        partition_of: impl Fn(&PoolKey) -> Option<Arc<Partition>>,
    ) -> Option<Arc<PoolKey>> {
        let n = self.keys.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let untried = (0..n)
            .map(|i| (start + i) % n)
            .filter(|i| tried & (1 << i) == 0);
        let mut best: Option<(usize, (bool, usize))> = None;
        let mut soonest: Option<(usize, Instant)> = None;
        for i in untried {
            let key = &self.keys[i];
            if let Some((until, _)) = key.aside_until(now) {
                if soonest.is_none_or(|(_, s)| until < s) {
                    soonest = Some((i, until));
                }
                continue;
            }
            let load = key.load(partition_of(key).as_deref(), now);
            if best.is_none_or(|(_, b)| load < b) {
                best = Some((i, load));
            }
        }
        best.map(|(i, _)| i)
            .or(soonest.map(|(i, _)| i))
            .map(|i| Arc::clone(&self.keys[i]))
    }

    /// Put `key` into `headers` and count it in flight until the guard drops.
    pub fn use_key(&self, key: &Arc<PoolKey>, headers: &mut http::HeaderMap) -> InFlight {
        headers.insert(self.header.clone(), key.value.clone());
        key.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(key))
    }

    /// Set `key` aside for the cool-down because of `why`.
    pub fn set_aside(&self, key: &PoolKey, why: &'static str, now: Instant) {
        key.aside.set(now + self.cooldown, why);
    }

    /// Take `key` out of its cool-down: what set it aside was not the key's doing.
    pub fn restore(&self, key: &PoolKey) {
        key.aside.clear();
    }

    pub fn cooldown(&self) -> Duration {
        self.cooldown
    }

    /// Whether another key than those in `tried` is usable now.
    pub fn has_another(&self, tried: u64, now: Instant) -> bool {
        self.keys
            .iter()
            .enumerate()
            .any(|(i, k)| tried & (1 << i) == 0 && k.aside_until(now).is_none())
    }

    /// `/status`: each key by number and fingerprint, its load, cool-down and partition.
    pub fn status(&self) -> serde_json::Value {
        let now = Instant::now();
        let keys: Vec<_> = self
            .keys
            .iter()
            .map(|k| {
                let aside = k.aside_until(now);
                serde_json::json!({
                    "key": k.number,
                    "fingerprint": k.fingerprint,
                    "in_flight": k.in_flight.load(Ordering::Relaxed),
                    "set_aside_ms": k.aside.left_ms(now),
                    "set_aside_for": aside.map(|(_, why)| why),
                    "limits": k.partition.status(),
                })
            })
            .collect();
        serde_json::Value::Array(keys)
    }
}

/// 8 hex digits of a stable hash of `key`: enough to tell keys apart in `/status`, nothing to
/// recover a key from.
pub fn fingerprint(key: &str) -> String {
    let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(key.as_bytes());
    format!("{:08x}", (hash >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::types::parse_base_url;
    use crate::config::Secret;

    /// Each key judged by its own partition (no model in the scope).
    fn own(key: &PoolKey) -> Option<Arc<Partition>> {
        Some(Arc::clone(&key.partition))
    }

    fn pool(keys: &[&str]) -> Pool {
        let mut config =
            UpstreamConfig::new("p", "/v1", parse_base_url("http://127.0.0.1:9/v1").unwrap());
        config.keys = keys.iter().map(|k| Secret((*k).into())).collect();
        config
            .headers
            .insert("authorization".into(), Secret("Bearer {key}".into()));
        Pool::new(&config, None, &Arc::default()).expect("a pool")
    }

    #[tokio::test]
    async fn idle_keys_take_turns_and_a_busy_key_is_passed_over() {
        let p = pool(&["sk-a", "sk-b", "sk-c"]);
        let now = Instant::now();
        let picks: Vec<usize> = (0..6)
            .map(|_| p.choose(0, now, own).unwrap().number)
            .collect();
        assert_eq!(picks, [1, 2, 3, 1, 2, 3]);
        let mut h = http::HeaderMap::new();
        let busy = p.choose(0, now, own).unwrap();
        let _guard = p.use_key(&busy, &mut h);
        assert_eq!(
            h["authorization"],
            format!("Bearer sk-{}", ["a", "b", "c"][busy.number - 1])
        );
        assert!(h["authorization"].is_sensitive());
        for _ in 0..6 {
            assert_ne!(p.choose(0, now, own).unwrap().number, busy.number);
        }
    }

    #[tokio::test]
    async fn a_key_set_aside_is_skipped_until_its_cooldown_ends() {
        let p = pool(&["sk-a", "sk-b"]);
        let now = Instant::now();
        p.set_aside(&p.keys[0], "401", now);
        for _ in 0..4 {
            assert_eq!(p.choose(0, now, own).unwrap().number, 2);
        }
        // Every untried key aside: the one whose cool-down ends first.
        p.set_aside(&p.keys[1], "quota", now + Duration::from_secs(1));
        assert_eq!(p.choose(0, now, own).unwrap().number, 1);
        assert!(!p.has_another(0, now));
        // After the cool-down both take turns again.
        let later = now + p.cooldown() + Duration::from_secs(2);
        let mut seen: Vec<usize> = (0..4)
            .map(|_| p.choose(0, later, own).unwrap().number)
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, [1, 1, 2, 2]);
        // A tried key is not offered again.
        assert_eq!(p.choose(0b01, later, own).unwrap().number, 2);
        assert!(p.choose(0b11, later, own).is_none());
    }

    #[test]
    fn fingerprints_differ_and_hide_the_key() {
        let (a, b) = (fingerprint("sk-live-aaaa"), fingerprint("sk-live-bbbb"));
        assert_ne!(a, b);
        assert_eq!(a.len(), 8);
        assert!(!a.contains("sk"));
        assert_eq!(a, fingerprint("sk-live-aaaa"), "stable");
    }
}
