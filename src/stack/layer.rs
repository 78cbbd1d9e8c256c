//! The shape every corral layer shares (metrics, concurrency, retry, breaker, rate limit,
//! timeout): state in an `Arc` built once per upstream ([`SharedLayer`]), a tower `Layer` that hands
//! clones of it to each service, and a call that may wait before and after the rest of the
//! stack. Written once here; each layer implements [`Middleware::call`] only.
//!
//! Also here: [`CatchPanicLayer`], tower-http's catch-panic in corral's shape (outermost in
//! every stack). Std mutexes are taken with [`crate::sync::lock`].

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::util::MapRequest;
use tower_http::catch_panic::ResponseForPanic;

use crate::body::{self, Body};
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;

/// The future every layer returns.
pub type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

/// What every layer's call comes to: the response head, or corral's refusal.
pub type Answer = Result<Response<Body>, ProxyError>;

/// The body of a stack's answer: tower-http's catch-panic boxes every body it passes, in its
/// own wrapper type, which goes on as it is (one box, not a second one around it).
pub type StackBody = tower_http::body::UnsyncBoxBody<bytes::Bytes, body::BoxError>;

/// The future of a whole stack (its [`CatchPanic`], outermost).
pub type StackFuture =
    Pin<Box<dyn Future<Output = Result<Response<StackBody>, ProxyError>> + Send>>;

/// The rest of the stack below a layer. Layers call each other through this, not through
/// tower's `Service`, so a request's way down the stack is one future, boxed once by the
/// [`Stack`](crate::stack::Stack) that holds it, not a box per layer.
pub trait Next: Clone + Send + Sync + 'static {
    /// Send `req` through the rest of the stack.
    fn send(self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + 'static;
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
    fn send(self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + 'static {
        tower::ServiceExt::oneshot(self.0, req)
    }
}

/// An optional layer (`ServiceBuilder::option_layer`): the layer, or the rest of the stack.
impl<A: Next, B: Next> Next for tower::util::Either<A, B> {
    fn send(self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + 'static {
        match self {
            Self::Left(a) => futures_util::future::Either::Left(a.send(req)),
            Self::Right(b) => futures_util::future::Either::Right(b.send(req)),
        }
    }
}

/// What a layer does with one request, `next` being the rest of the stack (a clone of it, to
/// call once or, for retries, to clone again per attempt).
pub trait Middleware: Send + Sync + 'static {
    fn call<S: Next>(
        self: Arc<Self>,
        next: S,
        req: ProxyRequest,
    ) -> impl Future<Output = Answer> + Send + 'static;
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
            inner: Arc::new(inner),
            shared: Arc::clone(&self.shared),
        }
    }
}

/// Middleware `M` in front of `inner`. Always ready: waiting happens inside the call, bounded
/// by the request's deadline.
///
/// The rest of the stack sits behind an `Arc`: each call hands the middleware a clone of it,
/// which is then two reference counts, not a copy of every layer below (that made a request
/// through six layers clone and drop the stack's handles some twenty times over).
pub struct Wrapped<M, S> {
    inner: Arc<S>,
    shared: Arc<M>,
}

impl<M, S> Clone for Wrapped<M, S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<M: Middleware, S: Next> Next for Wrapped<M, S> {
    fn send(self, req: ProxyRequest) -> impl Future<Output = Answer> + Send + 'static {
        self.shared.call(S::clone(&self.inner), req)
    }
}

/// A layer alone as a tower service (its own tests call it so); its future is boxed.
impl<M: Middleware, S: Next> tower::Service<ProxyRequest> for Wrapped<M, S> {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ProxyRequest) -> BoxFuture {
        Box::pin(self.clone().send(req))
    }
}

// ===== catch panic =====

/// What a panic below a [`CatchPanicLayer`] becomes: a 500 `internal` in corral's error shape,
/// counted (`corral_panics_total`, `corral_errors_total{cause="internal"}`) and logged.
#[derive(Clone)]
pub struct PanicAnswer(UpstreamMetrics);

impl ResponseForPanic for PanicAnswer {
    type ResponseBody = Body;

    fn response_for_panic(&mut self, panic: Box<dyn Any + Send + 'static>) -> Response<Body> {
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

/// tower-http's catch-panic for a stack of corral layers: a panic in any layer's `call` or
/// future below it (not in a response body already streaming: the client has its head, and
/// the connection is cut) is answered by [`PanicAnswer`] instead of closing the connection
/// with no reply. tower-http's service takes an `http::Request`, so a [`ProxyRequest`] rides in
/// one as its body, and its answer's body is tower-http's box of it ([`StackBody`]).
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
        let unwrap: fn(Request<ProxyRequest>) -> ProxyRequest = Request::into_body;
        CatchPanic(tower_http::catch_panic::CatchPanic::custom(
            MapRequest::new(inner, unwrap),
            self.0.clone(),
        ))
    }
}

/// `inner` taking its [`ProxyRequest`] out of the `http::Request` tower-http hands it.
type Unwrapped<S> = MapRequest<S, fn(Request<ProxyRequest>) -> ProxyRequest>;

/// The service of a [`CatchPanicLayer`].
#[derive(Clone)]
pub struct CatchPanic<S>(tower_http::catch_panic::CatchPanic<Unwrapped<S>, PanicAnswer>);

impl<S> tower::Service<ProxyRequest> for CatchPanic<S>
where
    S: tower::Service<ProxyRequest, Response = Response<Body>, Error = ProxyError, Future: Send>
        + Send
        + 'static,
{
    type Response = Response<StackBody>;
    type Error = ProxyError;
    type Future = StackFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: ProxyRequest) -> StackFuture {
        Box::pin(self.0.call(Request::new(req)))
    }
}
