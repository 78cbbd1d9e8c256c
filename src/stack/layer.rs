//! The shape every corral layer shares (metrics, concurrency, retry, breaker, rate limit,
//! timeout): state in an `Arc` built once per upstream ([`SharedLayer`]), a tower `Layer` that hands
//! clones of it to each service, and a call that may wait before and after the rest of the
//! stack. Written once here; each layer implements [`Middleware::call`] only.
//!
//! Also here: [`CatchPanicLayer`], outermost in every stack. Std mutexes are taken with
//! [`crate::sync::lock`].

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;

use crate::body::Body;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;

/// The future every layer returns.
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

/// What every layer's call comes to: the response head, or corral's refusal.
pub type Answer = Result<Response<Body>, ProxyError>;

/// The future of a whole stack (its [`CatchPanic`], outermost).
pub type StackFuture = BoxFuture;

/// The rest of the stack below a layer. Layers call each other through this, not through
/// tower's `Service`, and by reference: a request's way down the stack is one future, boxed
/// once at the stack's top ([`CatchPanic`]), which holds the one reference count a request
/// takes on the layers. Every worker thread shares those counts, and each change of one moves
/// its cache line between cores: a clone per layer would cost every request a dozen such
/// moves.
pub trait Next: Send + Sync + 'static {
    /// Send `req` through the rest of the stack.
    fn send(&self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + '_;
}

/// Any tower service as the rest of a stack (the tests' fake upstreams).
#[derive(Clone)]
pub struct Tower<S>(pub S);

impl<S> Next for Tower<S>
where
    S: tower::Service<ProxyRequest, Response = Response<Body>, Error = ProxyError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    fn send(&self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + '_ {
        tower::ServiceExt::oneshot(self.0.clone(), req)
    }
}

/// An optional layer (`ServiceBuilder::option_layer`): the layer, or the rest of the stack.
impl<A: Next, B: Next> Next for tower::util::Either<A, B> {
    fn send(&self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + '_ {
        match self {
            Self::Left(a) => futures_util::future::Either::Left(a.send(req)),
            Self::Right(b) => futures_util::future::Either::Right(b.send(req)),
        }
    }
}

/// What a layer does with one request, `next` being the rest of the stack (to call once or,
/// for retries, once per attempt).
pub trait Middleware: Send + Sync + 'static {
    fn call<'a, S: Next>(
        self: &'a Arc<Self>,
        next: &'a S,
        req: ProxyRequest,
    ) -> impl Future<Output = Answer> + Send + 'a;
}

/// The layer for middleware `M`, sharing one `M` among all its services.
pub struct SharedLayer<M> {
    shared: Arc<M>,
}

impl<M> SharedLayer<M> {
    pub const fn new(shared: Arc<M>) -> Self {
        Self { shared }
    }
}

impl<M> Clone for SharedLayer<M> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<M, S> tower::Layer<S> for SharedLayer<M> {
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

impl<M: Middleware, S: Next> Next for Wrapped<M, S> {
    fn send(&self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + '_ {
        self.shared.call(&self.inner, req)
    }
}

/// A layer alone as a tower service (its own tests call it so); its future is boxed.
impl<M: Middleware, S: Next + Clone> tower::Service<ProxyRequest> for Wrapped<M, S> {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ProxyRequest) -> BoxFuture {
        let this = self.clone();
        Box::pin(async move { this.send(req).await })
    }
}

// ===== catch panic =====

/// What a panic below a [`CatchPanicLayer`] becomes: a 500 `internal` in corral's error shape,
/// counted (`corral_panics_total`, `corral_errors_total{cause="internal"}`) and logged.
#[derive(Clone)]
pub struct PanicAnswer(UpstreamMetrics);

impl PanicAnswer {
    fn answer(&self, panic: &(dyn Any + Send)) -> Response<Body> {
        let message = panic
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        self.0.panics.inc();
        self.0.corral_error("internal");
        tracing::error!(
            upstream = self.0.name(),
            panic = message,
            "panic while serving a request; answered 500"
        );
        ProxyError::Internal("corral failed while serving this request".into()).into_response()
    }
}

/// The outermost layer of every stack: a panic in any layer's `call` or future below it, or
/// in the client (not in a response body already streaming: the client has its head, and
/// the connection is cut), is answered by [`PanicAnswer`] instead of closing the connection
/// with no reply. The layers below sit behind one `Arc`: a call takes one reference count, and
/// its future, boxed once, owns it while the layers borrow. The catch is futures-util's
/// `catch_unwind` around that one future. (tower-http's `CatchPanic` did this before: it takes
/// an `http::Request`, which a [`ProxyRequest`] had to ride in, put its own future around the
/// layers' boxed one, and boxed every response body again: two allocations a request.)
#[derive(Clone)]
pub struct CatchPanicLayer(PanicAnswer);

impl CatchPanicLayer {
    pub fn new(metrics: UpstreamMetrics) -> Self {
        Self(PanicAnswer(metrics))
    }
}

impl<S> tower::Layer<S> for CatchPanicLayer {
    type Service = CatchPanic<S>;

    fn layer(&self, inner: S) -> CatchPanic<S> {
        CatchPanic {
            layers: Arc::new(inner),
            answer: self.0.clone(),
        }
    }
}

/// The service of a [`CatchPanicLayer`]: the layers below it, and what a panic becomes.
pub struct CatchPanic<S> {
    layers: Arc<S>,
    answer: PanicAnswer,
}

impl<S> Clone for CatchPanic<S> {
    fn clone(&self) -> Self {
        Self {
            layers: Arc::clone(&self.layers),
            answer: self.answer.clone(),
        }
    }
}

impl<S: Next> tower::Service<ProxyRequest> for CatchPanic<S> {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ProxyRequest) -> BoxFuture {
        use futures_util::FutureExt;
        let (layers, answer) = (Arc::clone(&self.layers), self.answer.clone());
        Box::pin(async move {
            // The layers' `call`s run inside the caught future too: `send` is lazy.
            match std::panic::AssertUnwindSafe(async { layers.send(req).await })
                .catch_unwind()
                .await
            {
                Ok(answer) => answer,
                Err(panic) => Ok(answer.answer(&*panic)),
            }
        })
    }
}
