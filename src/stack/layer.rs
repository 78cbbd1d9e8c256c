//! The shape every corral layer shares (metrics, concurrency, retry, breaker, rate limit,
//! timeout): state in an `Arc` built once per upstream ([`Shared`]), a tower `Layer` that hands
//! clones of it to each service, and a call that may wait before and after the rest of the
//! stack. Written once here; each layer implements [`Middleware::call`] only.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;

use crate::body::Body;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;

/// The future every layer returns.
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

/// The rest of the stack below a layer.
pub trait Next:
    tower::Service<ProxyRequest, Response = Response<Body>, Error = ProxyError, Future: Send>
    + Clone
    + Send
    + 'static
{
}

impl<S> Next for S where
    S: tower::Service<ProxyRequest, Response = Response<Body>, Error = ProxyError, Future: Send>
        + Clone
        + Send
        + 'static
{
}

/// What a layer does with one request, `next` being the rest of the stack (a clone of it, to
/// call once or, for retries, to clone again per attempt).
pub trait Middleware: Send + Sync + 'static {
    fn call<S: Next>(self: Arc<Self>, next: S, req: ProxyRequest) -> BoxFuture;
}

/// The layer for middleware `M`, sharing one `M` among all its services.
pub struct Shared<M> {
    shared: Arc<M>,
}

impl<M> Shared<M> {
    pub const fn new(shared: Arc<M>) -> Self {
        Self { shared }
    }
}

impl<M> Clone for Shared<M> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<M, S> tower::Layer<S> for Shared<M> {
    type Service = Wrapped<M, S>;
    fn layer(&self, inner: S) -> Wrapped<M, S> {
        Wrapped {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Middleware `M` in front of `inner`. Always ready: waiting happens inside the call, bounded
/// by the request's deadline.
pub struct Wrapped<M, S> {
    inner: S,
    shared: Arc<M>,
}

impl<M, S: Clone> Clone for Wrapped<M, S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<M: Middleware, S: Next> tower::Service<ProxyRequest> for Wrapped<M, S> {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ProxyRequest) -> BoxFuture {
        Arc::clone(&self.shared).call(self.inner.clone(), req)
    }
}
