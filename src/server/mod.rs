//! The proxy's app: its state (the router, metrics, readiness, the config in force) and a
//! reload of its config. The jobs that use it sit beside it: the request path
//! ([`request`](self::request)), the admin answers ([`admin`](self::admin)), and serving,
//! draining and reloading on SIGHUP ([`run`](self::run)).

mod admin;
mod request;
mod run;

pub use self::run::{reload_on_hangup, run};

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::accept::ConnLimits;
use crate::access_log;
use crate::config::Config;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::router::{self, Router};
use crate::upstream::Upstream;
use arc_swap::ArcSwap;

/// Everything a connection needs to serve requests.
pub struct App {
    /// Swapped whole by a reload; each request takes the router in force when it arrives.
    router: ArcSwap<Router>,
    metrics: Metrics,
    ready: AtomicBool,
    admin_on_main: bool,
    limits: ConnLimits,
    drain_delay: Duration,
    drain_timeout: Duration,
    /// The config in force: what a reload compares against; its warnings are logged at start
    /// and listed by `/status`.
    config: ArcSwap<Config>,
    /// Connections open on the main listener.
    open_connections: Arc<AtomicUsize>,
    /// The fleet's Redis, with `[fleet] redis`.
    fleet: Option<Arc<Fleet>>,
    /// Which requests get a `request` line: `access_log` and `slow_request`, read per request
    /// without a lock, replaced by a reload.
    access_log: access_log::Policy,
}

impl App {
    pub fn new(config: &Config) -> Arc<Self> {
        let metrics = Metrics::new();
        let fleet = Fleet::new(&config.fleet, metrics.fleet());
        Arc::new(Self {
            router: ArcSwap::from_pointee(Router::new(
                &config.upstreams,
                &config.groups,
                config.max_buffered_bytes,
                &metrics,
                fleet.as_ref(),
            )),
            fleet,
            metrics,
            ready: AtomicBool::new(false),
            admin_on_main: config.admin_listen.is_none(),
            limits: ConnLimits::new(config),
            drain_delay: config.drain_delay.0,
            drain_timeout: config.drain_timeout.0,
            config: ArcSwap::from_pointee(config.clone()),
            open_connections: Arc::default(),
            access_log: access_log::Policy::new(config),
        })
    }

    /// Apply a reloaded config (SIGHUP): routes and upstreams change for new requests at once;
    /// upstreams whose config is unchanged keep their state (learned limits, breaker, queue);
    /// in-flight requests finish on what they started with. Settings of the listeners and the
    /// body buffer take effect on restart only, and a warning names them.
    pub fn reload(&self, config: &Config) -> router::ReloadSummary {
        // What is in force: the new upstreams, the old listeners and buffer (until restart).
        let mut config = config.clone();
        let restart_only = keep_restart_only(&self.config.load(), &mut config);
        if !restart_only.is_empty() {
            tracing::warn!(
                keys = restart_only.join(", "),
                "config reload: these settings take effect on restart only"
            );
        }
        let (router, summary) = self.router.load().reload(
            &config.upstreams,
            &config.groups,
            &self.metrics,
            self.fleet.as_ref(),
        );
        self.router.store(Arc::new(router));
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        self.access_log.set(&config);
        self.config.store(Arc::new(config));
        self.metrics.config_reload(true);
        tracing::info!(
            generation = self.metrics.config_generation.get(),
            kept = summary.kept,
            built = summary.built,
            removed = summary.removed,
            "config reloaded"
        );
        summary
    }

    /// The upstream named `name` in the config in force.
    pub fn upstream(&self, name: &str) -> Option<Arc<Upstream>> {
        let router = self.router.load();
        router.upstreams().iter().find(|u| u.name == name).cloned()
    }

    /// A reload whose config was refused: the old one stays.
    pub fn reload_refused(&self, error: &dyn std::fmt::Display) {
        self.metrics.config_reload(false);
        tracing::error!(
            error = %error,
            generation = self.metrics.config_generation.get(),
            "config reload refused; the config in force stays"
        );
    }

    /// Whether `/readyz` answers 200 (listening and not draining).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// Keep in `new` the top-level settings that apply only on restart (the listeners, their
/// connection limits, the drain, the body buffer) as they are in `old`; the names of those that
/// `new` would have changed.
fn keep_restart_only(old: &Config, new: &mut Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    macro_rules! keep {
        ($($key:ident),*) => {$(
            if new.$key != old.$key {
                changed.push(stringify!($key));
                new.$key = old.$key.clone();
            }
        )*};
    }
    keep!(
        fleet,
        listen,
        admin_listen,
        max_connections,
        first_byte_timeout,
        idle_timeout,
        write_timeout,
        http2_keep_alive_interval,
        drain_delay,
        drain_timeout,
        max_buffered_bytes
    );
    changed
}
