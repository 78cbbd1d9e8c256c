//! Pass-through behaviour of the proxy: status, headers and body unchanged; hop-by-hop headers,
//! Host and x-forwarded-for; header injection; 413, 404, absolute-form and CONNECT refusals;
//! admin endpoints.

mod support;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn passes_status_headers_and_body_through_unchanged() {
    let upstream = MockUpstream::start(|seen| async move {
        let mut r = json(
            418,
            serde_json::json!({"echo": String::from_utf8_lossy(&seen.body)}),
        );
        r.headers_mut()
            .insert("x-ratelimit-remaining-requests", "7".parse().unwrap());
        r.headers_mut().insert("x-custom", "kept".parse().unwrap());
        r
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let (parts, body) = send(
        &client(),
        post(&corral.url("/v1/chat/completions?x=1"), "{\"a\":1}"),
    )
    .await;
    assert_eq!(parts.status, 418);
    assert_eq!(parts.headers["x-ratelimit-remaining-requests"], "7");
    assert_eq!(parts.headers["x-custom"], "kept");
    assert!(parts.headers.get("x-corral-error").is_none());
    assert_eq!(&body[..], br#"{"echo":"{\"a\":1}"}"#);
    let seen = upstream.last();
    assert_eq!(seen.uri.path(), "/v1/chat/completions");
    assert_eq!(seen.uri.query(), Some("x=1"));
    assert_eq!(seen.method, "POST");
    assert_eq!(&seen.body[..], b"{\"a\":1}");
}

#[tokio::test]
async fn rewrites_host_strips_hop_by_hop_and_appends_forwarded_for() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let req = Request::post(corral.url("/v1/x"))
        .header("connection", "x-secret-hop")
        .header("x-secret-hop", "1")
        .header("proxy-authorization", "Basic abc")
        .header("te", "trailers")
        .header("x-forwarded-for", "203.0.113.9")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let (parts, _) = send(&client(), req).await;
    assert_eq!(parts.status, 200);
    let seen = upstream.last();
    assert_eq!(seen.headers["host"], upstream.addr.to_string());
    for hop in ["x-secret-hop", "proxy-authorization", "te", "keep-alive"] {
        assert!(
            !seen.headers.contains_key(hop),
            "{hop} reached the upstream"
        );
    }
    assert_eq!(seen.headers["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
}

#[tokio::test]
async fn injects_headers_by_mode() {
    std::env::set_var("CORRAL_TEST_INJECT_KEY", "sk-injected");
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let cfg = one_upstream(
        &upstream,
        "[upstream.headers]\nAuthorization = \"Bearer ${CORRAL_TEST_INJECT_KEY}\"\nx-org = \"org-1\"",
    );
    let corral = Corral::start(&cfg).await;
    send(&client(), post(&corral.url("/v1/a"), "{}")).await;
    assert_eq!(
        upstream.last().headers["authorization"],
        "Bearer sk-injected"
    );
    assert_eq!(upstream.last().headers["x-org"], "org-1");

    let mut own = post(&corral.url("/v1/a"), "{}");
    own.headers_mut()
        .insert("authorization", "Bearer client-key".parse().unwrap());
    send(&client(), own).await;
    assert_eq!(
        upstream.last().headers["authorization"],
        "Bearer client-key",
        "if_absent keeps the client's"
    );

    let always = Corral::start(&one_upstream(
        &upstream,
        "header_mode = \"always\"\n[upstream.headers]\nAuthorization = \"Bearer ${CORRAL_TEST_INJECT_KEY}\"",
    ))
    .await;
    let mut own = post(&always.url("/v1/a"), "{}");
    own.headers_mut()
        .insert("authorization", "Bearer client-key".parse().unwrap());
    send(&client(), own).await;
    assert_eq!(
        upstream.last().headers["authorization"],
        "Bearer sk-injected",
        "always replaces"
    );
}

#[tokio::test]
async fn oversized_body_gets_413_json_and_never_reaches_upstream() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "body_limit = \"1KiB\"")).await;
    let big = "x".repeat(2048);
    let (parts, body) = send(&client(), post(&corral.url("/v1/chat/completions"), &big)).await;
    assert_eq!(parts.status, 413);
    assert_eq!(parts.headers["x-corral-error"], "body_too_large");
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["code"], "body_too_large");
    assert!(json["error"]["message"].as_str().unwrap().contains("1024"));
    assert_eq!(upstream.calls(), 0);
    let (ok, _) = send(
        &client(),
        post(&corral.url("/v1/chat/completions"), &"y".repeat(1024)),
    )
    .await;
    assert_eq!(ok.status, 200, "a body exactly at the limit passes");
}

#[tokio::test]
async fn unknown_path_gets_404_json() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let (parts, body) = send(&client(), post(&corral.url("/v2/chat"), "{}")).await;
    assert_eq!(parts.status, 404);
    assert_eq!(parts.headers["x-corral-error"], "no_route");
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["type"], "invalid_request_error");
    assert_eq!(upstream.calls(), 0);
}

/// Raw HTTP/1.1 so the request line can carry an absolute URI or CONNECT.
async fn raw(corral: &Corral, request: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(corral.addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = vec![0u8; 4096];
    let n = stream.read(&mut out).await.unwrap();
    String::from_utf8_lossy(&out[..n]).into_owned()
}

#[tokio::test]
async fn refuses_absolute_form_and_connect() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let abs = raw(&corral, "GET http://example.com/v1/models HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n\r\n").await;
    assert!(abs.starts_with("HTTP/1.1 400"), "{abs}");
    assert!(abs.contains("x-corral-error: absolute_form"), "{abs}");
    let connect = raw(
        &corral,
        "CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n",
    )
    .await;
    assert!(connect.starts_with("HTTP/1.1 405"), "{connect}");
    assert!(
        connect.contains("x-corral-error: connect_refused"),
        "{connect}"
    );
    assert_eq!(upstream.calls(), 0);
}

#[tokio::test]
async fn admin_endpoints_on_main_listener_are_never_forwarded() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    send(&c, post(&corral.url("/v1/chat/completions"), "{}")).await;
    let get = |p: &str| {
        Request::get(corral.url(p))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let (h, _) = send(&c, get("/healthz")).await;
    assert_eq!(h.status, 200);
    let (r, _) = send(&c, get("/readyz")).await;
    assert_eq!(r.status, 200);
    let (m, text) = send(&c, get("/metrics")).await;
    assert_eq!(m.status, 200);
    let text = String::from_utf8(text.to_vec()).unwrap();
    for needle in [
        r#"corral_requests_total{code="200",method="POST",upstream="mock"} 1"#,
        "corral_upstream_duration_seconds_bucket",
        r#"corral_in_flight_requests{upstream="mock"} 0"#,
        r#"corral_request_bytes_total{upstream="mock"} 2"#,
        r#"corral_response_bytes_total{upstream="mock"} 2"#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test]
async fn admin_listen_moves_admin_endpoints_off_the_main_port() {
    let upstream =
        MockUpstream::start(|_| async { json(200, serde_json::json!({"up": true})) }).await;
    let config = corral::config::load_str(
        "t.toml",
        &format!(
            "admin_listen = \"127.0.0.1:0\"\n{}",
            one_upstream(&upstream, "").replace("route = \"/v1\"", "route = \"/\"")
        ),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (main_addr, admin_addr) = (listener.local_addr().unwrap(), admin.local_addr().unwrap());
    let app = corral::server::App::new(&config);
    let task = tokio::spawn(corral::server::run(
        app,
        listener,
        Some(admin),
        std::future::pending::<()>(),
    ));
    let c = client();
    let get = |a: std::net::SocketAddr, p: &str| {
        Request::get(format!("http://{a}{p}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let (on_admin, _) = send(&c, get(admin_addr, "/metrics")).await;
    assert_eq!(on_admin.status, 200);
    let (on_main, body) = send(&c, get(main_addr, "/metrics")).await;
    assert_eq!(on_main.status, 200);
    assert_eq!(
        &body[..],
        br#"{"up":true}"#,
        "with admin_listen, /metrics on the main port is forwarded"
    );
    task.abort();
}

#[tokio::test]
async fn serves_h2c_clients() {
    let upstream =
        MockUpstream::start(|_| async { json(200, serde_json::json!({"h2": true})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let h2: TestClient =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let response = h2
        .request(post(&corral.url("/v1/chat/completions"), "{}"))
        .await
        .unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    assert_eq!(upstream.calls(), 1);
}
