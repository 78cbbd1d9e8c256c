//! What a partition's lease tells it of its fleet's peers ([`peers`]).

use std::sync::{Arc, Mutex, Weak};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::answers::ADMISSION_MEMORY;
use super::{Pacers, Pause};
use crate::fleet::Peers;
use crate::sync::lock;

/// What a partition's lease tells it of its fleet's peers: their pauses extend `pause`, their
/// refusals and shares reach `pacers`, and an admission control found through them extends
/// `admission` and forgets the cuts its refusals made.
pub(super) fn peers(
    pacers: Option<&Arc<Mutex<Pacers>>>,
    pause: &Arc<Pause>,
    admission: &Arc<Pause>,
) -> Peers {
    let shared = Arc::clone(pause);
    let learners = pacers.map(Arc::downgrade);
    let sharers = learners.clone();
    let (readers, scalers) = (learners.clone(), learners.clone());
    let forgetters = learners.clone();
    let queue = Arc::clone(admission);
    // Every replica's first send after a pause was refused: an admission control's.
    let admission_found = move || {
        queue.extend(Instant::now() + ADMISSION_MEMORY);
        if let Some(pacers) = forgetters.as_ref().and_then(Weak::upgrade) {
            let mut p = lock(&pacers);
            p.requests.forget_cuts();
            p.tokens.forget_cuts();
        }
    };
    // Each replica's phase after a peer's refusal, its own draw (`Pacer::peer_throttled`).
    let phases = Mutex::new(SmallRng::from_os_rng());
    let edge = move |requests: bool, tokens: bool| {
        let pacers = learners.as_ref().and_then(Weak::upgrade)?;
        let phase = lock(&phases).random_range(0.0..1.0);
        let mut p = lock(&pacers);
        let now = Instant::now();
        if requests {
            p.requests.peer_throttled(now, phase);
        }
        if tokens {
            p.tokens.peer_throttled(now, phase);
        }
        p.requests.take_estimate()
    };
    let share = move |rate: f64| {
        if let Some(pacers) = sharers.as_ref().and_then(Weak::upgrade) {
            lock(&pacers).requests.fleet_share(rate, Instant::now());
        }
    };
    let pace = move || {
        let pacers = readers.as_ref().and_then(Weak::upgrade)?;
        let pace = lock(&pacers).requests.fleet_pace(Instant::now());
        pace
    };
    let scale = move |scale: f64| {
        if let Some(pacers) = scalers.as_ref().and_then(Weak::upgrade) {
            lock(&pacers).requests.fleet_scale(scale, Instant::now());
        }
    };
    Peers {
        pause: Box::new(move |until| shared.extend(until)),
        edge: Box::new(edge),
        share: Box::new(share),
        pace: Box::new(pace),
        scale: Box::new(scale),
        admission: Box::new(admission_found),
    }
}
