//! Credentials over real sockets through `server::run`: an upstream or group member that injects
//! a credential (a configured `Authorization`, `api-key`, `x-api-key`, or a key pool) receives
//! none of the client's other credential headers; one that injects none gets the client's as
//! they came; the rate-limit partition follows the credential that goes upstream, not the
//! headers the client chose; and a config error never quotes a secret, at start-up or when a
//! reload is refused.

mod support;

use support::group::{group_config, ok, quota, BODY};
use support::*;

/// The credential headers a client may send.
const CLIENT_CREDENTIALS: [(&str, &str); 4] = [
    ("authorization", "Bearer sk-client-openai"),
    ("api-key", "client-azure"),
    ("x-api-key", "client-anthropic"),
    ("x-goog-api-key", "client-gemini"),
];

/// An upstream that records what it receives and answers `status`.
async fn recording(status: u16) -> MockUpstream {
    let body = if status == 429 { quota() } else { ok() };
    always(status, body).await
}

/// A chat request carrying every credential header in `credentials`.
fn with_credentials(
    url: &str,
    credentials: &[(&str, &str)],
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let mut req = post(url, BODY);
    for (name, value) in credentials {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    req
}

/// The credential headers `seen` carried, by name, as `name=value`.
fn credentials(seen: &Seen) -> Vec<String> {
    let mut found: Vec<String> = CLIENT_CREDENTIALS
        .iter()
        .filter_map(|(name, _)| {
            let v = seen.headers.get(*name)?;
            Some(format!("{name}={}", v.to_str().unwrap()))
        })
        .collect();
    found.sort();
    found
}

/// Upstreams `primary` (first, answering a permanent 429) and `backup` behind the group `chat`
/// at `/v1`, each with its `[upstream.headers]` lines.
fn group(
    primary: &MockUpstream,
    p_headers: &str,
    backup: &MockUpstream,
    b_headers: &str,
) -> String {
    group_config(
        primary,
        &format!("[upstream.headers]\n{p_headers}"),
        backup,
        &format!("[upstream.headers]\n{b_headers}"),
        "",
    )
}

/// The client's OpenAI key does not follow the request to an Azure backup that injects its
/// own `api-key`: each member gets its own credential (the client's own where it names the
/// member's header, under `if_absent`) and none of the client's others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_injects_a_credential_gets_none_of_the_clients_others() {
    let (primary, backup) = (recording(429).await, recording(200).await);
    let toml = group(
        &primary,
        "Authorization = \"Bearer sk-corral-openai\"\n",
        &backup,
        "api-key = \"corral-azure\"\n",
    );
    let corral = Corral::start(&toml).await;
    let url = corral.url("/v1/chat/completions");
    let only_bearer = [CLIENT_CREDENTIALS[0]];
    let (parts, _) = send(&client(), with_credentials(&url, &only_bearer)).await;
    assert_eq!(parts.status, 200);
    assert_eq!(parts.headers["x-corral-upstream"], "backup");
    assert_eq!(
        credentials(&primary.last()),
        ["authorization=Bearer sk-client-openai"]
    );
    assert_eq!(credentials(&backup.last()), ["api-key=corral-azure"]);

    // Every credential a client may send: each member keeps only the one it names; the
    // primary's cool-down sends this one straight to the backup, so ask through a new corral.
    let corral = Corral::start(&toml).await;
    let url = corral.url("/v1/chat/completions");
    let (parts, _) = send(&client(), with_credentials(&url, &CLIENT_CREDENTIALS)).await;
    assert_eq!(parts.status, 200);
    assert_eq!(
        credentials(&primary.last()),
        ["authorization=Bearer sk-client-openai"]
    );
    assert_eq!(credentials(&backup.last()), ["api-key=client-azure"]);
}

/// In a group with a member that passes the client's credentials through, the client's key is
/// that member's: a member that injects a credential of the same name sends its own, even under
/// `if_absent` (the client's OpenAI key never reaches a Groq backup).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_key_for_a_pass_through_member_never_reaches_an_injecting_one() {
    let (primary, backup) = (recording(429).await, recording(200).await);
    let toml = group(
        &primary,
        "",
        &backup,
        "Authorization = \"Bearer sk-corral-groq\"\n",
    );
    let corral = Corral::start(&toml).await;
    let url = corral.url("/v1/chat/completions");
    let only_bearer = [CLIENT_CREDENTIALS[0]];
    let (parts, _) = send(&client(), with_credentials(&url, &only_bearer)).await;
    assert_eq!(parts.status, 200);
    assert_eq!(parts.headers["x-corral-upstream"], "backup");
    assert_eq!(
        credentials(&primary.last()),
        ["authorization=Bearer sk-client-openai"]
    );
    assert_eq!(
        credentials(&backup.last()),
        ["authorization=Bearer sk-corral-groq"]
    );
}

/// A member that injects no credential gets the client's as they came, even when another
/// member injects one; a header another member injects is kept from a member that injects a
/// credential, which sends its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_injects_none_gets_the_clients_credentials() {
    let (primary, backup) = (recording(429).await, recording(200).await);
    let toml = group(
        &primary,
        "x-goog-api-key = \"corral-gemini\"\n",
        &backup,
        "OpenAI-Organization = \"org-corral\"\n",
    );
    let corral = Corral::start(&toml).await;
    let url = corral.url("/v1/chat/completions");
    let mut req = with_credentials(&url, &CLIENT_CREDENTIALS);
    req.headers_mut()
        .insert("openai-organization", "org-client".parse().unwrap());
    let (parts, _) = send(&client(), req).await;
    assert_eq!(parts.headers["x-corral-upstream"], "backup");
    assert_eq!(
        credentials(&primary.last()),
        ["x-goog-api-key=corral-gemini"],
        "the member injecting x-goog-api-key sends its own: beside a pass-through member, the \
         client's credentials are that member's"
    );
    assert!(
        !primary.last().headers.contains_key("openai-organization"),
        "nor a header another member injects"
    );
    let mut all: Vec<String> = CLIENT_CREDENTIALS
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect();
    all.sort();
    assert_eq!(credentials(&backup.last()), all);
    // Its own header follows `header_mode`: the client's wins under `if_absent`.
    assert_eq!(backup.last().headers["openai-organization"], "org-client");
}

/// One upstream on its own route behaves as a member does: its own credential, none of the
/// client's others; and a pooled key likewise travels alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_or_a_pool_that_injects_a_credential_gets_none_of_the_clients_others() {
    let upstream = recording(200).await;
    let corral = Corral::start(&one_upstream(
        &upstream,
        "[upstream.headers]\nx-api-key = \"corral-anthropic\"\n",
    ))
    .await;
    let url = corral.url("/v1/chat/completions");
    let (parts, _) = send(&client(), with_credentials(&url, &[CLIENT_CREDENTIALS[0]])).await;
    assert_eq!(parts.status, 200);
    assert_eq!(
        credentials(&upstream.last()),
        ["x-api-key=corral-anthropic"]
    );

    let pool = "keys = [\"sk-pool-a\", \"sk-pool-b\"]\n[upstream.headers]\napi-key = \"{key}\"\n";
    let corral = Corral::start(&one_upstream(&upstream, pool)).await;
    let url = corral.url("/v1/chat/completions");
    let others = [CLIENT_CREDENTIALS[0], CLIENT_CREDENTIALS[2]];
    let (parts, _) = send(&client(), with_credentials(&url, &others)).await;
    assert_eq!(parts.status, 200);
    let seen = credentials(&upstream.last());
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].starts_with("api-key=sk-pool-"), "{seen:?}");

    // Under `if_absent` the client's own key in the pool's header wins, as before.
    let (parts, _) = send(&client(), with_credentials(&url, &CLIENT_CREDENTIALS)).await;
    assert_eq!(parts.status, 200);
    assert_eq!(credentials(&upstream.last()), ["api-key=client-azure"]);
}

/// The number of rate-limit partitions `/status` lists for the only upstream.
async fn partitions(corral: &Corral) -> serde_json::Value {
    let req = http::Request::get(corral.url("/status"))
        .body(http_body_util::Full::default())
        .unwrap();
    let (_, status) = send(&client(), req).await;
    let status: serde_json::Value = serde_json::from_slice(&status).unwrap();
    status["upstreams"][0]["rate_limit"]["partitions"].clone()
}

/// With `partition = "api_key"`, junk `Authorization` values from clients make no partitions
/// of their own on an upstream that injects its own credential under another name: the
/// partition follows the credential that goes upstream, one for the one real key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partition_follows_the_injected_credential_not_the_clients_junk() {
    for header in ["api-key", "x-goog-api-key"] {
        let upstream = recording(200).await;
        let extra = format!(
            "[upstream.limits]\npartition = \"api_key\"\n[upstream.headers]\n{header} = \"corral-key\"\n"
        );
        let corral = Corral::start(&one_upstream(&upstream, &extra)).await;
        let url = corral.url("/v1/chat/completions");
        for junk in ["Bearer junk-1", "Bearer junk-2", "Bearer junk-3"] {
            let (parts, _) = send(
                &client(),
                with_credentials(&url, &[("authorization", junk)]),
            )
            .await;
            assert_eq!(parts.status, 200);
            assert_eq!(upstream.last().headers[header], "corral-key");
        }
        assert_eq!(partitions(&corral).await, 1, "{header}");
    }
}

/// Configs whose secrets are written in the wrong shape after a valid first upstream: pool
/// keys as a string, `[fleet]` as a bare Redis URL with its password; and the key each error
/// must name.
fn misshapen_secrets(upstream: &MockUpstream) -> [(String, &'static str); 2] {
    let head = format!(
        "listen = \"127.0.0.1:0\"\ndrain_delay = \"0s\"\n\
         [[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"{}\"\n",
        upstream.url("/v1")
    );
    [
        (
            format!("{head}keys = \"sk-live-SECRETVALUE\"\n[upstream.headers]\nAuthorization = \"Bearer {{key}}\"\n"),
            "upstream.keys",
        ),
        (
            format!("fleet = \"redis://:SECRETVALUE@127.0.0.1:6379/0\"\n{head}"),
            "fleet",
        ),
    ]
}

/// A temporary directory for one test's config file.
fn temp_dir(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("corral-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Started on such a config, `corral` and `corral check-config` exit 2 with an error that
/// names the key and quotes no secret.
#[tokio::test]
async fn a_misshapen_secret_is_not_quoted_at_start_up() {
    let upstream = recording(200).await;
    let dir = temp_dir("secret-start");
    let path = dir.join("corral.toml");
    for (toml, key) in misshapen_secrets(&upstream) {
        std::fs::write(&path, &toml).unwrap();
        for args in [
            vec!["--config".as_ref(), path.as_os_str()],
            vec!["check-config".as_ref(), path.as_os_str()],
        ] {
            let out = support::binary::corral_std_command(&args).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
            assert!(stderr.contains(&format!(": {key}: ")), "{args:?}: {stderr}");
            assert!(
                !stderr.contains("SECRET"),
                "{args:?} shows a secret: {stderr}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reload refused for such a config logs `config reload refused` with an error that names
/// the key and quotes no secret; the config in force stays.
#[tokio::test]
async fn a_misshapen_secret_is_not_quoted_when_a_reload_is_refused() {
    use support::binary::{corral_command, Running};
    let upstream = recording(200).await;
    let dir = temp_dir("secret-reload");
    let path = dir.join("corral.toml");
    let good = one_upstream(&upstream, "").replace(
        "drain_timeout",
        "listen = \"127.0.0.1:0\"\ndrain_delay = \"0s\"\ndrain_timeout",
    );
    std::fs::write(&path, good).unwrap();
    let corral = Running::spawn(
        corral_command(["--config".as_ref(), path.as_os_str()]),
        false,
    )
    .await;
    let refusals = |corral: &Running| -> Vec<String> {
        let log = corral.log();
        log.into_iter()
            .filter(|l| l.contains("config reload refused"))
            .collect()
    };
    for (n, (toml, key)) in misshapen_secrets(&upstream).into_iter().enumerate() {
        std::fs::write(&path, &toml).unwrap();
        corral.signal("HUP");
        // Bound: 10 s for a signal and a log line on a busy machine.
        let refused = eventually(std::time::Duration::from_secs(10), || {
            refusals(&corral).len() > n
        })
        .await;
        let log = corral.log().join("\n");
        assert!(refused, "no refusal logged; log:\n{log}");
        assert!(
            refusals(&corral)[n].contains(&format!(": {key}: ")),
            "{log}"
        );
        assert!(!log.contains("SECRET"), "the log shows a secret:\n{log}");
    }
    let (parts, _) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
    assert_eq!(parts.status, 200, "the config in force stays");
    corral.sigterm();
    let (status, _) = corral.wait().await;
    assert!(status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
