//! `deploy/`: the Dockerfile and the Kubernetes example, checked against the real binary.
//!
//! - Dockerfile: the stages, user and port are as documented; every flag and `CORRAL_*`
//!   variable it passes exists in `corral --help`; the baked config passes `check-config`; and
//!   the image's command line, run here on the host, serves `/healthz` and `/readyz`.
//! - Kubernetes: every core manifest validates strictly against the Kubernetes schemas
//!   `kubernetes-validate` ships (`tests/python/k8s_manifests.py` under `$CORRAL_PYTHON`, which
//!   also turns the YAML into JSON for the assertions here); the Job's sidecar, probes,
//!   resources, securityContext, secret handling and scrape annotations; the PodMonitor's
//!   fields; the ConfigMap's `corral.toml` through `check-config` and a real run.
//! - The fleet (`deploy/kubernetes/fleet`): the same strict validation; the workers'
//!   Deployment runs the Job's sidecar with the same checks; its Redis URL names the Redis
//!   Service and a port that reaches redis-server, which the NetworkPolicy lets the workers
//!   reach; Redis is one disposable, restricted instance; the fleet's `corral.toml` through
//!   `check-config` and a real run with its Redis unreachable (it serves at once, and falls
//!   back to its local share).
//! - The drain (`drain_delay` + `drain_timeout`) of the baked config fits `docker stop`'s 10 s,
//!   the sidecar's fits the pod's `terminationGracePeriodSeconds`.
//!
//! Without `CORRAL_PYTHON` the Kubernetes tests fail, unless `CORRAL_SKIP_PYTHON=1`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use support::binary::{corral_command, corral_std_command, Running};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Kubernetes versions the manifests must validate against: the first with native sidecars
/// on by default, and the newest schema kubernetes-validate ships.
const K8S_VERSIONS: &[&str] = &["1.29.0", "latest"];

fn repo(path: &str) -> PathBuf {
    Path::new(ROOT).join(path)
}

// ===== running the binary =====

/// `corral --help`, once.
fn help() -> &'static str {
    static HELP: OnceLock<String> = OnceLock::new();
    HELP.get_or_init(|| {
        let out = corral_std_command(["--help"])
            .output()
            .expect("run corral --help");
        assert!(out.status.success(), "corral --help failed");
        String::from_utf8(out.stdout).expect("UTF-8 help")
    })
}

/// Every `--flag` in `args` is one of corral's.
fn assert_flags_exist(args: &[String], whose: &str) {
    for arg in args {
        let Some(flag) = arg.strip_prefix("--") else {
            continue;
        };
        let name = flag.split('=').next().unwrap_or_default();
        assert!(
            help().contains(&format!("--{name} ")) || help().contains(&format!("--{name}\n")),
            "{whose} passes `--{name}`, which `corral --help` does not list:\n{}",
            help()
        );
    }
}

/// `corral check-config PATH` with extra environment; panics with its output unless it passes.
fn check_config(path: &Path, env: &[(&str, &str)]) -> String {
    let mut cmd = corral_std_command([std::ffi::OsStr::new("check-config"), path.as_os_str()]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run corral check-config");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "corral check-config {} failed:\n{stdout}{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `corral ARGS` with `env`, started as a container would start it, until it listens (and, with
/// `admin`, its admin endpoints do).
async fn start(args: &[String], env: &[(&str, &str)], admin: bool) -> Running {
    let mut cmd = corral_command(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Running::spawn(cmd, admin).await
}

// ===== Dockerfile =====

/// One instruction: keyword (upper case) and the rest of its logical line.
#[derive(Debug, Clone)]
struct Instruction {
    keyword: String,
    args: String,
}

/// The Dockerfile's instructions, continuation lines joined, comments dropped, split by stage
/// (each starting with its FROM).
fn dockerfile_stages() -> Vec<Vec<Instruction>> {
    let text = std::fs::read_to_string(repo("deploy/Dockerfile")).expect("read deploy/Dockerfile");
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                logical.push(std::mem::take(&mut current));
            }
        }
    }
    assert!(current.is_empty(), "Dockerfile ends inside a continuation");
    let mut stages: Vec<Vec<Instruction>> = Vec::new();
    for line in logical {
        let (keyword, args) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let ins = Instruction {
            keyword: keyword.to_ascii_uppercase(),
            args: args.trim().to_owned(),
        };
        if ins.keyword == "FROM" {
            stages.push(Vec::new());
        }
        stages
            .last_mut()
            .expect("the Dockerfile starts with FROM")
            .push(ins);
    }
    stages
}

fn find<'a>(stage: &'a [Instruction], keyword: &str) -> Vec<&'a Instruction> {
    stage.iter().filter(|i| i.keyword == keyword).collect()
}

/// The single `keyword` instruction of `stage`.
fn only<'a>(stage: &'a [Instruction], keyword: &str) -> &'a Instruction {
    let found = find(stage, keyword);
    assert_eq!(found.len(), 1, "exactly one {keyword}: {found:?}");
    found[0]
}

/// An exec-form instruction (`["a", "b"]`) as its list.
fn exec_form(ins: &Instruction) -> Vec<String> {
    serde_json::from_str(&ins.args).unwrap_or_else(|e| {
        panic!(
            "{} must use the exec form (a JSON array), so signals reach corral: {e}: {}",
            ins.keyword, ins.args
        )
    })
}

/// `COPY [--flags] SRC... DEST` -> (flags, sources, dest).
fn copy_parts(ins: &Instruction) -> (Vec<&str>, Vec<&str>, &str) {
    let words: Vec<&str> = ins.args.split_whitespace().collect();
    let (flags, paths): (Vec<&str>, Vec<&str>) = words.iter().partition(|w| w.starts_with("--"));
    let (dest, sources) = paths.split_last().expect("COPY SRC DEST");
    (flags, sources.to_vec(), dest)
}

/// `ENV K=V ...` of a stage.
fn env_of(stage: &[Instruction]) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for ins in find(stage, "ENV") {
        for pair in ins.args.split_whitespace() {
            let (k, v) = pair
                .split_once('=')
                .unwrap_or_else(|| panic!("write ENV as KEY=VALUE: {}", ins.args));
            env.insert(k.to_owned(), v.trim_matches('"').to_owned());
        }
    }
    env
}

/// The value following `flag` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(String::as_str)
}

#[test]
fn dockerfile_builds_release_and_runs_on_distroless_as_non_root() {
    let stages = dockerfile_stages();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let (build, runtime) = (&stages[0], &stages[1]);
    let from = &build[0].args;
    let (image, alias) = from.split_once(" AS ").expect("FROM <image> AS <name>");
    assert!(
        image.starts_with("rust:") && image.contains("bookworm"),
        "builder is Debian bookworm's rust image (so its glibc matches distroless cc-debian12): {image}"
    );
    let cargo = find(build, "RUN")
        .into_iter()
        .find(|r| r.args.contains("cargo build"))
        .expect("a RUN with cargo build");
    assert!(
        cargo.args.contains("cargo build --release --locked"),
        "release build from Cargo.lock: {}",
        cargo.args
    );
    assert_eq!(
        runtime[0].args, "gcr.io/distroless/cc-debian12:nonroot",
        "runtime image"
    );

    // The binary: built, copied from the build stage, and the entrypoint.
    let entrypoint = exec_form(only(runtime, "ENTRYPOINT"));
    assert_eq!(
        entrypoint.len(),
        1,
        "ENTRYPOINT is the binary; flags go in CMD"
    );
    let copies = find(runtime, "COPY");
    let binary = copies
        .iter()
        .map(|c| copy_parts(c))
        .find(|(flags, _, _)| flags.contains(&format!("--from={alias}").as_str()))
        .expect("COPY --from=<build stage>");
    assert_eq!(
        binary.2, entrypoint[0],
        "the copied binary is the entrypoint"
    );
    assert!(
        cargo.args.contains(binary.1[0]),
        "the build RUN puts the binary where COPY --from takes it ({}): {}",
        binary.1[0],
        cargo.args
    );

    // Non-root, numerically (Kubernetes' runAsNonRoot cannot check a user name).
    let user = &only(runtime, "USER").args;
    let ids: Vec<u32> = user
        .split(':')
        .map(|id| {
            id.parse()
                .unwrap_or_else(|_| panic!("numeric USER uid:gid, got {user}"))
        })
        .collect();
    assert!(ids.iter().all(|&id| id != 0), "USER is not root: {user}");
    assert_eq!(ids[0], 65532, "distroless' nonroot user");

    // Port 8080, and corral listens on it on every interface.
    assert_eq!(only(runtime, "EXPOSE").args, "8080");
    let env = env_of(runtime);
    let listen: SocketAddr = env
        .get("CORRAL_LISTEN")
        .expect("ENV CORRAL_LISTEN (the embedded default listens on loopback only)")
        .parse()
        .expect("CORRAL_LISTEN is host:port");
    assert!(
        listen.ip().is_unspecified(),
        "reachable from outside: {listen}"
    );
    assert_eq!(listen.port(), 8080, "listens on the EXPOSEd port");
}

#[test]
fn dockerfile_flags_env_and_config_path_match_the_binary() {
    let stages = dockerfile_stages();
    let runtime = stages.last().unwrap();
    let cmd = exec_form(only(runtime, "CMD"));
    assert_flags_exist(&cmd, "the Dockerfile's CMD");
    for name in env_of(runtime).keys() {
        assert!(
            help().contains(&format!("[env: {name}=")),
            "ENV {name} is not a variable corral reads:\n{}",
            help()
        );
    }
    // The baked config: copied from the repository to the path CMD names.
    let config_path = flag_value(&cmd, "--config").expect("CMD passes --config");
    let baked = find(runtime, "COPY")
        .into_iter()
        .map(copy_parts)
        .find(|(_, _, dest)| *dest == config_path)
        .unwrap_or_else(|| panic!("no COPY puts a config at {config_path}"));
    assert!(
        baked.0.is_empty(),
        "the config comes from the build context"
    );
    let source = repo(baked.1[0]);
    assert!(source.is_file(), "{} exists", source.display());
    check_config(&source, &[]);
    let ignore = std::fs::read_to_string(repo("deploy/Dockerfile.dockerignore"))
        .expect("read deploy/Dockerfile.dockerignore");
    for needed in ["Cargo.toml", "Cargo.lock", "src", "deploy"] {
        for pattern in ignore.lines().filter(|l| !l.trim().starts_with('#')) {
            let p = pattern.trim().trim_end_matches('/');
            assert!(
                p.is_empty() || !(needed.starts_with(p) || p == "*" || p == "**"),
                "Dockerfile.dockerignore pattern `{pattern}` drops `{needed}`"
            );
        }
    }
}

/// The image's ENTRYPOINT and CMD, run here: the config path mapped to the repository's copy,
/// `CORRAL_LISTEN` to an ephemeral loopback port.
#[tokio::test]
async fn the_image_command_line_serves() {
    let stages = dockerfile_stages();
    let runtime = stages.last().unwrap();
    let cmd = exec_form(only(runtime, "CMD"));
    let config_path = flag_value(&cmd, "--config").expect("CMD passes --config");
    let baked = find(runtime, "COPY")
        .into_iter()
        .map(copy_parts)
        .find(|(_, _, dest)| *dest == config_path)
        .expect("COPY of the config")
        .1[0];
    let args: Vec<String> = cmd
        .iter()
        .map(|a| match a.as_str() {
            p if p == config_path => repo(baked).display().to_string(),
            other => other.to_owned(),
        })
        .collect();
    let corral = start(&args, &[("CORRAL_LISTEN", "127.0.0.1:0")], false).await;
    assert_eq!(corral.get(corral.addr, "/healthz").await.0, 200);
    assert_eq!(corral.get(corral.addr, "/readyz").await.0, 200);
    let log = corral.log().join("\n");
    assert!(log.contains("\"level\":\"INFO\""), "JSON logs: {log}");
}

// ===== the drain fits the grace periods =====

/// Time between SIGTERM and exit that the drain may take up front, for the process to exit.
const EXIT_MARGIN: Duration = Duration::from_secs(1);
/// How long `docker stop` waits after SIGTERM before SIGKILL, by default.
const DOCKER_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// What corral takes from SIGTERM to exit at most: the effective `drain_delay` (still serving,
/// `/readyz` 503) plus `drain_timeout`, as `check-config` prints them (defaults filled in), plus
/// [`EXIT_MARGIN`].
fn drain_of(printed: &str) -> Duration {
    let config: toml::Value = toml::from_str(printed).expect("check-config prints TOML");
    let duration = |key: &str| {
        let text = config[key]
            .as_str()
            .unwrap_or_else(|| panic!("check-config prints `{key}`:\n{printed}"));
        humantime::parse_duration(text).unwrap_or_else(|e| panic!("`{key}` = {text}: {e}"))
    };
    duration("drain_delay") + duration("drain_timeout") + EXIT_MARGIN
}

#[test]
fn the_baked_config_drains_within_docker_stops_wait() {
    let stages = dockerfile_stages();
    let runtime = stages.last().unwrap();
    for stop in find(runtime, "STOPSIGNAL") {
        assert_eq!(stop.args, "SIGTERM", "the drain delay follows SIGTERM");
    }
    let drain = drain_of(&check_config(&repo("deploy/corral.toml"), &[]));
    assert!(
        drain <= DOCKER_STOP_TIMEOUT,
        "deploy/corral.toml drains for up to {drain:?}; `docker stop` kills after {DOCKER_STOP_TIMEOUT:?}"
    );
}

#[test]
fn the_sidecar_drains_within_the_pods_grace_period() {
    let Some(m) = manifests() else { return };
    assert_drains_within_grace(m, &doc(m, "Job")["spec"]["template"]["spec"]);
}

/// The drain of the loaded directory's sidecar config fits `pod`'s grace period.
fn assert_drains_within_grace(m: &Value, pod: &Value) {
    // Kubernetes' default when the field is absent.
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30));
    let (text, _) = sidecar_config(m);
    // One file per ConfigMap: the Job's and the fleet's are checked side by side.
    let configmap = doc(m, "ConfigMap")["metadata"]["name"].as_str().unwrap();
    let path = std::env::temp_dir().join(format!(
        "corral-deploy-drain-{configmap}-{}.toml",
        std::process::id()
    ));
    std::fs::write(&path, &text).expect("write the sidecar config");
    let printed = check_config(&path, &[("OPENAI_API_KEY", "sk-deploy-drain")]);
    let _ = std::fs::remove_file(&path);
    let drain = drain_of(&printed);
    assert!(
        drain <= grace,
        "the sidecar drains for up to {drain:?}; the pod's grace period is {grace:?}"
    );
}

// ===== Kubernetes =====

/// The manifests in `dir` (under the repository) as JSON, validated against the Kubernetes
/// schemas; `None` when `CORRAL_SKIP_PYTHON=1`.
fn load_manifests(dir: &str) -> Option<Value> {
    let python = support::python::python("kubernetes-validate")?;
    let script = repo("tests/python/k8s_manifests.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(repo(dir))
        .args(K8S_VERSIONS)
        .output()
        .unwrap_or_else(|e| panic!("cannot run CORRAL_PYTHON=`{python}`: {e}"));
    assert!(
        out.status.success(),
        "{python} {} {dir} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");
    assert!(
        !parsed["files"].as_object().expect("files").is_empty(),
        "no *.yaml in {dir}"
    );
    Some(parsed)
}

/// `deploy/kubernetes` (the Job), loaded once.
fn manifests() -> Option<&'static Value> {
    static OUT: OnceLock<Option<Value>> = OnceLock::new();
    OUT.get_or_init(|| load_manifests("deploy/kubernetes"))
        .as_ref()
}

/// Every document of `kind` in a loaded directory.
fn docs<'a>(manifests: &'a Value, kind: &str) -> Vec<&'a Value> {
    manifests["files"]
        .as_object()
        .expect("files")
        .values()
        .flat_map(|d| d.as_array().expect("documents"))
        .filter(|d| d["kind"] == kind)
        .collect()
}

/// The one document of `kind` in a loaded directory.
fn doc<'a>(manifests: &'a Value, kind: &str) -> &'a Value {
    let docs = docs(manifests, kind);
    assert_eq!(docs.len(), 1, "exactly one {kind}");
    docs[0]
}

fn containers(pod: &Value, field: &str) -> Vec<Value> {
    pod[field].as_array().cloned().unwrap_or_default()
}

fn named<'a>(list: &'a [Value], name: &str) -> &'a Value {
    list.iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container `{name}`"))
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

/// The ConfigMap's `corral.toml`, parsed.
fn sidecar_config(m: &Value) -> (String, toml::Value) {
    let text = doc(m, "ConfigMap")["data"]["corral.toml"]
        .as_str()
        .expect("the ConfigMap holds corral.toml")
        .to_owned();
    let parsed = toml::from_str(&text).expect("corral.toml is TOML");
    (text, parsed)
}

/// The port number a probe or endpoint names, by name or number, on `container`.
fn port_number(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().expect("port is a name or a number");
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no containerPort named `{name}` on {}", container["name"]))
}

#[test]
fn kubernetes_manifests_validate_against_the_kubernetes_schemas() {
    let Some(m) = manifests() else { return };
    // Only the custom resource and kustomize's own file have no Kubernetes schema.
    assert_validated(m, &["ConfigMap", "Job"], &["Kustomization", "PodMonitor"]);
    assert_kustomization(m, &doc(m, "Job")["spec"]["template"]["spec"]);
}

/// No schema errors; every document validated against every [`K8S_VERSIONS`] but those of the
/// `unchecked` kinds, which no shipped schema covers (and are all that was skipped); and
/// documents of each of `kinds` among them.
fn assert_validated(m: &Value, kinds: &[&str], unchecked: &[&str]) {
    let errors = m["errors"].as_array().expect("errors");
    assert!(errors.is_empty(), "schema errors: {errors:#?}");
    let checked: BTreeSet<(String, String, String, String)> = m["checked"]
        .as_array()
        .expect("checked")
        .iter()
        .map(|c| {
            let field = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (
                field("file"),
                field("kind"),
                field("name"),
                field("version"),
            )
        })
        .collect();
    let mut seen = BTreeSet::new();
    for (file, documents) in m["files"].as_object().expect("files") {
        for d in documents.as_array().expect("documents") {
            let kind = d["kind"].as_str().expect("kind");
            if unchecked.contains(&kind) {
                continue;
            }
            seen.insert(kind);
            let name = d["metadata"]["name"].as_str().expect("metadata.name");
            for version in K8S_VERSIONS {
                let key = (file.clone(), kind.into(), name.into(), (*version).into());
                assert!(
                    checked.contains(&key),
                    "{file}: {kind} {name} not validated for {version}: {checked:?}"
                );
            }
        }
    }
    for kind in kinds {
        assert!(seen.contains(kind), "no {kind} validated: {seen:?}");
    }
    let skipped: BTreeSet<&str> = m["skipped"]
        .as_array()
        .expect("skipped")
        .iter()
        .map(|s| s["kind"].as_str().unwrap())
        .collect();
    assert_eq!(skipped, unchecked.iter().copied().collect::<BTreeSet<_>>());
}

/// kustomization.yaml lists every manifest, and renames the image `pod`'s sidecar uses.
fn assert_kustomization(m: &Value, pod: &Value) {
    let kustomization = doc(m, "Kustomization");
    let resources: BTreeSet<&str> = kustomization["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    let files: BTreeSet<&str> = m["files"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|f| *f != "kustomization.yaml")
        .collect();
    assert_eq!(resources, files, "kustomization resources");
    let sidecar_image = named(&containers(pod, "initContainers"), "corral")["image"].clone();
    let images = kustomization["images"].as_array().expect("images");
    assert!(
        images.iter().any(|i| i["name"] == sidecar_image),
        "kustomization images rename {sidecar_image}"
    );
}

#[test]
fn job_runs_corral_as_a_native_sidecar_holding_the_key() {
    let Some(m) = manifests() else { return };
    let job = doc(m, "Job");
    assert_eq!(job["apiVersion"], "batch/v1");
    let template = &job["spec"]["template"];
    let pod = &template["spec"];
    assert!(
        ["Never", "OnFailure"].contains(&pod["restartPolicy"].as_str().unwrap_or_default()),
        "a Job's pod restartPolicy"
    );
    assert_sidecar_pod(m, template);
}

/// `template` (a pod template of the loaded directory `m`) runs corral as a native sidecar with
/// the directory's ConfigMap, holding the key its other containers never see; its probes and
/// scrape annotations on the admin listener; resources and a restrictive securityContext on
/// every container.
fn assert_sidecar_pod(m: &Value, template: &Value) {
    let pod = &template["spec"];
    // corral never talks to the Kubernetes API: no service account token in the pod.
    assert_eq!(
        pod["automountServiceAccountToken"], false,
        "the pod mounts a service account token"
    );
    let inits = containers(pod, "initContainers");
    let mains = containers(pod, "containers");
    let corral = named(&inits, "corral");
    assert_eq!(
        corral["restartPolicy"], "Always",
        "native sidecar: an init container with restartPolicy Always"
    );

    // The sidecar's command line and config.
    let args: Vec<String> = serde_json::from_value(corral["args"].clone()).expect("args");
    assert_flags_exist(&args, "the sidecar's args");
    let config_path = flag_value(&args, "--config").expect("args pass --config");
    let (dir, file) = config_path.rsplit_once('/').expect("absolute path");
    let mount = corral["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|v| v["mountPath"] == dir)
        .unwrap_or_else(|| panic!("nothing mounted at {dir}"));
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    let configmap = doc(m, "ConfigMap");
    assert_eq!(volume["configMap"]["name"], configmap["metadata"]["name"]);
    assert!(
        configmap["data"][file].is_string(),
        "the ConfigMap has key {file}"
    );
    let (_, config) = sidecar_config(m);

    // Loopback proxy, set by env over the image's 0.0.0.0, and the config agrees.
    let listen = env_value(corral, "CORRAL_LISTEN").expect("CORRAL_LISTEN on the sidecar");
    let listen: SocketAddr = listen["value"].as_str().unwrap().parse().unwrap();
    assert!(
        listen.ip().is_loopback(),
        "the proxy is pod-local: {listen}"
    );
    assert_eq!(config["listen"].as_str(), Some(listen.to_string().as_str()));

    // The key: a Secret on the sidecar only, injected with header_mode = "always".
    let key = env_value(corral, "OPENAI_API_KEY").expect("OPENAI_API_KEY on the sidecar");
    let secret = &key["valueFrom"]["secretKeyRef"];
    assert!(
        secret["name"].is_string() && secret["key"].is_string(),
        "{key}"
    );
    let upstream = &config["upstream"][0];
    assert_eq!(upstream["header_mode"].as_str(), Some("always"));
    assert_eq!(
        upstream["headers"]["Authorization"].as_str(),
        Some("Bearer ${OPENAI_API_KEY}")
    );
    let secret_volumes: BTreeSet<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v.get("secret").is_some() || v.get("projected").is_some())
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    for c in &mains {
        let name = &c["name"];
        for e in c["env"].as_array().into_iter().flatten() {
            assert!(
                e["valueFrom"].get("secretKeyRef").is_none(),
                "{name} reads a Secret: {e}"
            );
        }
        for e in c["envFrom"].as_array().into_iter().flatten() {
            assert!(e.get("secretRef").is_none(), "{name} reads a Secret: {e}");
        }
        for v in c["volumeMounts"].as_array().into_iter().flatten() {
            let volume = v["name"].as_str().unwrap();
            assert!(!secret_volumes.contains(volume), "{name} mounts a Secret");
        }
        // Its client goes through corral.
        let route = upstream["route"].as_str().unwrap();
        let base = env_value(c, "OPENAI_BASE_URL").expect("OPENAI_BASE_URL");
        assert_eq!(base["value"], format!("http://{listen}{route}"));
        assert_eq!(base["value"], "http://127.0.0.1:8080/v1");
    }

    // Probes on the admin listener, which the kubelet can reach.
    let admin: SocketAddr = config["admin_listen"]
        .as_str()
        .expect("admin_listen, so probes and scrapes need not reach the loopback proxy")
        .parse()
        .unwrap();
    assert!(admin.ip().is_unspecified(), "kubelet reaches {admin}");
    for (probe, path) in [
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/readyz"),
    ] {
        let get = &corral[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(
            port_number(corral, &get["port"]),
            u64::from(admin.port()),
            "{probe} port"
        );
    }

    // Resources and a restrictive securityContext on every container.
    assert_restricted(pod);

    // Prometheus' scrape annotations point at the admin port.
    let annotations = &template["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], admin.port().to_string());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
}

/// Every container of `pod`: CPU and memory requests and limits; non-root, read-only root
/// filesystem, no privilege escalation, every capability dropped; the pod's RuntimeDefault
/// seccomp profile.
fn assert_restricted(pod: &Value) {
    let pod_sc = &pod["securityContext"];
    assert_eq!(pod_sc["seccompProfile"]["type"], "RuntimeDefault");
    for c in containers(pod, "initContainers")
        .iter()
        .chain(&containers(pod, "containers"))
    {
        let name = &c["name"];
        for kind in ["requests", "limits"] {
            for resource in ["cpu", "memory"] {
                assert!(
                    c["resources"][kind][resource].is_string(),
                    "{name}: resources.{kind}.{resource}"
                );
            }
        }
        let sc = &c["securityContext"];
        let effective = |key: &str| {
            if sc.get(key).is_some() {
                sc[key].clone()
            } else {
                pod_sc[key].clone()
            }
        };
        assert_eq!(effective("runAsNonRoot"), true, "{name}: runAsNonRoot");
        assert_ne!(effective("runAsUser"), 0, "{name}: runAsUser");
        assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
        assert_ne!(sc["privileged"], true, "{name}");
        assert_eq!(
            sc["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{name}"
        );
        assert!(
            sc["capabilities"].get("add").is_none(),
            "{name} adds capabilities"
        );
    }
}

#[test]
fn podmonitor_selects_the_pods_and_their_metrics_port() {
    let Some(m) = manifests() else { return };
    let pm = doc(m, "PodMonitor");
    assert_eq!(pm["apiVersion"], "monitoring.coreos.com/v1");
    assert!(pm["metadata"]["name"].is_string(), "metadata.name");
    let spec = &pm["spec"];
    // Fields of the Operator's PodMonitor spec (a typo would be dropped without a word).
    let known_spec = [
        "selector",
        "namespaceSelector",
        "podMetricsEndpoints",
        "jobLabel",
        "podTargetLabels",
        "sampleLimit",
        "targetLimit",
        "labelLimit",
        "labelNameLengthLimit",
        "labelValueLengthLimit",
        "keepDroppedTargets",
        "attachMetadata",
        "scrapeClass",
        "scrapeProtocols",
    ];
    for key in spec.as_object().expect("spec").keys() {
        assert!(
            known_spec.contains(&key.as_str()),
            "unknown PodMonitor spec field `{key}`"
        );
    }
    // Required by the CRD: a selector; and endpoints to scrape.
    let selector = spec["selector"]["matchLabels"]
        .as_object()
        .expect("spec.selector.matchLabels");
    assert!(!selector.is_empty(), "an empty selector matches every pod");
    let template = &doc(m, "Job")["spec"]["template"];
    for (k, v) in selector {
        assert_eq!(
            &template["metadata"]["labels"][k], v,
            "the Job's pods carry the selected label {k}"
        );
    }
    let pod = &template["spec"];
    let corral = named(&containers(pod, "initContainers"), "corral").clone();
    let (_, config) = sidecar_config(m);
    let admin: SocketAddr = config["admin_listen"].as_str().unwrap().parse().unwrap();
    let endpoints = spec["podMetricsEndpoints"]
        .as_array()
        .expect("spec.podMetricsEndpoints");
    assert!(!endpoints.is_empty(), "podMetricsEndpoints");
    let known_endpoint = [
        "port",
        "portNumber",
        "targetPort",
        "path",
        "scheme",
        "params",
        "interval",
        "scrapeTimeout",
        "honorLabels",
        "honorTimestamps",
        "trackTimestampsStaleness",
        "metricRelabelings",
        "relabelings",
        "proxyUrl",
        "basicAuth",
        "bearerTokenSecret",
        "authorization",
        "oauth2",
        "tlsConfig",
        "followRedirects",
        "enableHttp2",
        "filterRunning",
    ];
    for e in endpoints {
        for key in e.as_object().expect("endpoint").keys() {
            assert!(
                known_endpoint.contains(&key.as_str()),
                "unknown podMetricsEndpoints field `{key}`"
            );
        }
        // The Operator matches `port` against container port names.
        let port = e["port"].as_str().expect("port: a container port name");
        assert_eq!(
            port_number(&corral, &e["port"]),
            u64::from(admin.port()),
            "port `{port}` is corral's admin listener"
        );
        assert_eq!(e["path"], "/metrics");
        if let Some(interval) = e["interval"].as_str() {
            let digits = interval.trim_end_matches(|c: char| c.is_ascii_alphabetic());
            assert!(
                !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()),
                "interval is a Prometheus duration: {interval}"
            );
        }
    }
}

/// Memory an idle corral takes (release build: 11 MiB RSS measured), with room to spare.
const IDLE_RSS: usize = 32 << 20;
/// What the allocator may keep beyond the bytes in use while bodies come and go, as a fraction of
/// the request buffer: glibc's heap keeps large freed buffers for reuse (`benches/load.sh`
/// measured 31 MiB over a full 128 MiB buffer, against `MALLOC_MMAP_THRESHOLD_=131072`).
const HEAP_SLACK: f64 = 0.5;
/// What each request in flight or queued holds besides its body: its connection's buffers, its
/// head and its task (the load test's 2,000 connections took about 35 KiB each beyond the
/// buffer and the heap's slack), rounded up to a 64 KiB head.
const PER_REQUEST: usize = 64 << 10;
/// A retryable error body buffered to judge it (`stack/retry`), at most once per slot.
const ERROR_BODY: usize = 64 << 10;

/// `"256Mi"`, `"1Gi"`, `"512M"`, `"1000"` in bytes.
fn quantity(q: &str) -> usize {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let factor: usize = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        other => panic!("unit `{other}` in quantity `{q}`"),
    };
    n.parse::<usize>().expect("a number") * factor
}

/// The sidecar's `body_limit`, `queue_size` and request buffer fit its memory limit: an idle
/// corral, the buffer full (with the heap's slack), every request in flight or queued, and a
/// retryable error body per slot, all at once, stay under the container's limit.
#[test]
fn sidecar_body_limit_and_queue_size_fit_its_memory_limit() {
    let Some(m) = manifests() else { return };
    assert_fits_memory_limit(m, &doc(m, "Job")["spec"]["template"]["spec"]);
}

/// The loaded directory's sidecar config fits the memory limit of `pod`'s corral (see
/// [`sidecar_body_limit_and_queue_size_fit_its_memory_limit`]).
fn assert_fits_memory_limit(m: &Value, pod: &Value) {
    let inits = containers(pod, "initContainers");
    let corral = named(&inits, "corral");
    let limit = quantity(
        corral["resources"]["limits"]["memory"]
            .as_str()
            .expect("a memory limit on the sidecar"),
    );
    let (text, _) = sidecar_config(m);
    let config = corral::config::load_str(
        "corral.toml",
        &text.replace("${OPENAI_API_KEY}", "sk-deploy-test"),
    )
    .expect("the sidecar's config loads");
    // Unset, corral takes a quarter of the limit it reads from its cgroup.
    let buffer = config.max_buffered_bytes.map_or_else(
        || corral::forward::buffer::cap_for(Some(limit as u64)),
        |b| b.0,
    );
    let mut worst = IDLE_RSS + buffer + (buffer as f64 * HEAP_SLACK) as usize;
    let mut lines = vec![format!(
        "idle {} MiB + buffer {} MiB + heap slack {} MiB",
        IDLE_RSS >> 20,
        buffer >> 20,
        (buffer as f64 * HEAP_SLACK) as usize >> 20
    )];
    let connections = config.max_connections.get() as usize;
    let per_connection = corral::accept::H2_CONNECTION_WINDOW as usize;
    worst += connections * per_connection;
    lines.push(format!(
        "{connections} connections x {} KiB unread (HTTP/2 window; HTTP/1 reads at most 64 KiB)",
        per_connection >> 10
    ));
    for up in &config.upstreams {
        assert!(
            up.body_limit.0 <= buffer,
            "{}: body_limit {} over the buffer {buffer}",
            up.name(),
            up.body_limit.0
        );
        let slots = up.limits.max_concurrency.get() as usize;
        let requests = slots + up.limits.queue_size;
        worst += requests * PER_REQUEST + slots * ERROR_BODY;
        lines.push(format!(
            "{}: {requests} requests x {} KiB + {slots} error bodies x {} KiB",
            up.name(),
            PER_REQUEST >> 10,
            ERROR_BODY >> 10
        ));
    }
    assert!(
        worst <= limit,
        "the sidecar may need {} MiB, over its {} MiB limit:\n{}",
        worst >> 20,
        limit >> 20,
        lines.join("\n")
    );
}

/// The sidecar's `corral.toml` passes `check-config` and, run as the sidecar runs it, serves
/// the probe paths and `/metrics` on the admin listener.
#[tokio::test]
async fn sidecar_config_is_valid_and_serves_the_probes() {
    let Some(m) = manifests() else { return };
    let (text, _) = sidecar_config(m);
    let path = std::env::temp_dir().join(format!("corral-deploy-{}.toml", std::process::id()));
    std::fs::write(&path, &text).expect("write the sidecar config");
    let key = "sk-deploy-test-key";
    let printed = check_config(&path, &[("OPENAI_API_KEY", key)]);
    assert!(
        !printed.contains(key),
        "check-config hides the key:\n{printed}"
    );
    let args: Vec<String> = [
        "--config",
        path.to_str().unwrap(),
        "--log-format",
        "json",
        "--admin-listen",
        "127.0.0.1:0",
    ]
    .map(String::from)
    .to_vec();
    let env = [("OPENAI_API_KEY", key), ("CORRAL_LISTEN", "127.0.0.1:0")];
    let corral = start(&args, &env, true).await;
    let admin = corral.admin.expect("admin listener");
    assert_eq!(corral.get(admin, "/healthz").await, (200, "ok\n".into()));
    assert_eq!(corral.get(admin, "/readyz").await, (200, "ready\n".into()));
    let (status, metrics) = corral.get(admin, "/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("corral_in_flight_requests{upstream=\"openai\"}"));
    let _ = std::fs::remove_file(&path);
}

// ===== Kubernetes: the fleet =====

/// `deploy/kubernetes/fleet` (workers sharing one key's limit through Redis), loaded once.
fn fleet_manifests() -> Option<&'static Value> {
    static OUT: OnceLock<Option<Value>> = OnceLock::new();
    OUT.get_or_init(|| load_manifests("deploy/kubernetes/fleet"))
        .as_ref()
}

/// The Deployment whose replicas share the limit.
const FLEET_WORKERS: &str = "llm-workers";
/// The port redis-server listens on unless told `--port`.
const REDIS_DEFAULT_PORT: u64 = 6379;
/// How long a sidecar with Redis unreachable may take to serve `/readyz`, and to answer a
/// request.
const WITHOUT_REDIS: Duration = Duration::from_secs(5);

/// The one document of `kind` named `name`.
fn doc_named<'a>(m: &'a Value, kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs(m, kind)
        .into_iter()
        .filter(|d| d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind} `{name}`");
    found[0]
}

/// Whether a pod with `labels` matches the label selector `selector` (a `matchLabels` map, or
/// a Service's `selector`); an empty one matches every pod.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| &labels[k] == v)
}

/// The workers' pod template.
fn fleet_workers(m: &Value) -> &Value {
    &doc_named(m, "Deployment", FLEET_WORKERS)["spec"]["template"]
}

/// The Redis Service and the one Deployment whose pods it selects.
fn fleet_redis(m: &Value) -> (&Value, &Value) {
    let service = doc(m, "Service");
    let selector = &service["spec"]["selector"];
    assert!(
        selector.as_object().is_some_and(|s| !s.is_empty()),
        "the Service selects pods by label: {selector}"
    );
    let selected: Vec<&Value> = docs(m, "Deployment")
        .into_iter()
        .filter(|d| selects(selector, &d["spec"]["template"]["metadata"]["labels"]))
        .collect();
    assert_eq!(
        selected.len(),
        1,
        "the Service selects the pods of exactly one Deployment (Redis'), not the workers'"
    );
    (service, selected[0])
}

/// The single container of `pod`, and the port its redis-server listens on.
fn redis_container(pod: &Value) -> (Value, u64) {
    assert!(
        containers(pod, "initContainers").is_empty(),
        "Redis' pod has no init containers"
    );
    let all = containers(pod, "containers");
    assert_eq!(all.len(), 1, "Redis' pod runs redis-server only");
    let args: Vec<String> =
        serde_json::from_value(all[0]["args"].clone()).expect("redis-server's args");
    let port = flag_value(&args, "--port").map_or(REDIS_DEFAULT_PORT, |p| {
        p.parse().expect("--port is a number")
    });
    let declared = all[0]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|p| p["containerPort"] == port);
    assert!(declared, "Redis' container declares its port {port}");
    (all[0].clone(), port)
}

/// `text` in a file of its own under the temporary directory.
fn temp_config(tag: &str, text: &str) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("corral-deploy-{tag}-{}.toml", std::process::id()));
    std::fs::write(&path, text).expect("write a config");
    path
}

#[test]
fn fleet_manifests_validate_against_the_kubernetes_schemas() {
    let Some(m) = fleet_manifests() else { return };
    // Every document but kustomize's own file, each for every version.
    assert_validated(
        m,
        &["ConfigMap", "Deployment", "Service", "NetworkPolicy"],
        &["Kustomization"],
    );
    assert_eq!(docs(m, "Deployment").len(), 2, "the workers and Redis");
    assert_kustomization(m, &fleet_workers(m)["spec"]);
}

/// The workers' Deployment runs corral as a native sidecar, with every check the Job's gets;
/// and it is the Job's sidecar, field for field, but for its ConfigMap.
#[test]
fn fleet_workers_run_corral_as_a_native_sidecar_like_the_job() {
    let (Some(m), Some(job_m)) = (fleet_manifests(), manifests()) else {
        return;
    };
    let deployment = doc_named(m, "Deployment", FLEET_WORKERS);
    assert_eq!(deployment["apiVersion"], "apps/v1");
    let spec = &deployment["spec"];
    let replicas = spec["replicas"].as_u64().expect("spec.replicas");
    assert!(replicas > 1, "a fleet: replicas share the key ({replicas})");
    let template = &spec["template"];
    let labels = &template["metadata"]["labels"];
    let selector = &spec["selector"]["matchLabels"];
    assert!(
        selector.as_object().is_some_and(|s| !s.is_empty()) && selects(selector, labels),
        "the Deployment's selector {selector} matches its pods' labels {labels}"
    );
    let pod = &template["spec"];
    assert!(
        matches!(pod["restartPolicy"].as_str(), None | Some("Always")),
        "a Deployment's pods restart Always: {}",
        pod["restartPolicy"]
    );
    assert_sidecar_pod(m, template);

    let job_pod = &doc(job_m, "Job")["spec"]["template"]["spec"];
    let job_corral = named(&containers(job_pod, "initContainers"), "corral").clone();
    let corral = named(&containers(pod, "initContainers"), "corral").clone();
    for field in [
        "image",
        "imagePullPolicy",
        "restartPolicy",
        "args",
        "ports",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
        "volumeMounts",
    ] {
        assert_eq!(
            corral[field], job_corral[field],
            "the workers' sidecar `{field}` differs from the Job's"
        );
    }
    for e in job_corral["env"].as_array().expect("the Job's sidecar env") {
        let name = e["name"].as_str().unwrap();
        assert_eq!(
            env_value(&corral, name),
            Some(e),
            "the workers' sidecar env {name}"
        );
    }
    for field in ["securityContext", "automountServiceAccountToken"] {
        assert_eq!(pod[field], job_pod[field], "the workers' pod `{field}`");
    }
    assert_ne!(
        pod["volumes"], job_pod["volumes"],
        "the workers mount their own ConfigMap"
    );

    // ../podmonitor.yaml scrapes these sidecars too: its selector and port name.
    let pm = &doc(job_m, "PodMonitor")["spec"];
    assert!(
        selects(&pm["selector"]["matchLabels"], labels),
        "the PodMonitor selects the workers' pods"
    );
    for e in pm["podMetricsEndpoints"].as_array().expect("endpoints") {
        port_number(&corral, &e["port"]);
    }
}

#[test]
fn fleet_sidecar_drains_within_the_grace_period_and_fits_its_memory_limit() {
    let Some(m) = fleet_manifests() else { return };
    let pod = &fleet_workers(m)["spec"];
    assert_drains_within_grace(m, pod);
    assert_fits_memory_limit(m, pod);
}

/// The Redis URL the sidecar uses names the Service in redis.yaml and a port of it that
/// reaches redis-server; the NetworkPolicy lets the workers in; no Service's environment
/// variables (which Kubernetes puts into the pods) collide with corral's.
#[test]
fn fleet_sidecar_redis_url_names_the_redis_service() {
    let Some(m) = fleet_manifests() else { return };
    let workers = fleet_workers(m);
    let corral = named(&containers(&workers["spec"], "initContainers"), "corral").clone();
    let (_, config) = sidecar_config(m);
    // What corral connects to: CORRAL_REDIS over the config's [fleet] redis.
    let url = match env_value(&corral, "CORRAL_REDIS") {
        Some(e) => e["value"]
            .as_str()
            .unwrap_or_else(|| panic!("CORRAL_REDIS is not a literal, so unchecked: {e}"))
            .to_owned(),
        None => config
            .get("fleet")
            .and_then(|f| f.get("redis"))
            .and_then(toml::Value::as_str)
            .expect("[fleet] redis in corral.toml, or CORRAL_REDIS on the sidecar")
            .to_owned(),
    };
    let uri: http::Uri = url.parse().expect("the Redis URL parses");
    assert_eq!(uri.scheme_str(), Some("redis"), "{url}");
    let (service, redis) = fleet_redis(m);
    let service_name = service["metadata"]["name"].as_str().unwrap();
    let host = uri.host().expect("the Redis URL names a host");
    assert!(
        host == service_name || host.starts_with(&format!("{service_name}.")),
        "the Redis URL's host `{host}` is the Service `{service_name}`"
    );
    let port = uri.port_u16().map_or(REDIS_DEFAULT_PORT, u64::from);
    let service_port = service["spec"]["ports"]
        .as_array()
        .expect("the Service's ports")
        .iter()
        .find(|p| p["port"] == port)
        .unwrap_or_else(|| panic!("the Service has no port {port}: {}", service["spec"]));
    let (redis_c, listens) = redis_container(&redis["spec"]["template"]["spec"]);
    let target = match service_port.get("targetPort") {
        Some(t) => port_number(&redis_c, t),
        None => port,
    };
    assert_eq!(
        target, listens,
        "the Service's port {port} reaches redis-server's {listens}"
    );

    // The NetworkPolicies on Redis' pods let the workers in on that port.
    let redis_labels = &redis["spec"]["template"]["metadata"]["labels"];
    let worker_labels = &workers["metadata"]["labels"];
    let policies: Vec<&Value> = docs(m, "NetworkPolicy")
        .into_iter()
        .filter(|np| selects(&np["spec"]["podSelector"]["matchLabels"], redis_labels))
        .collect();
    assert!(
        !policies.is_empty(),
        "a NetworkPolicy guards the password-less Redis"
    );
    for np in policies {
        let spec = &np["spec"];
        assert!(
            spec["podSelector"].get("matchExpressions").is_none(),
            "matchLabels only, so this test can read it"
        );
        let admits = spec["ingress"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|rule| {
                let from = rule["from"].as_array().is_none_or(|peers| {
                    peers.iter().any(|p| {
                        p.get("namespaceSelector").is_none()
                            && p.get("ipBlock").is_none()
                            && selects(&p["podSelector"]["matchLabels"], worker_labels)
                    })
                });
                let ports = rule["ports"].as_array().is_none_or(|ports| {
                    ports.iter().any(|p| {
                        p.get("port").is_none() || port_number(&redis_c, &p["port"]) == listens
                    })
                });
                from && ports
            });
        assert!(
            admits,
            "NetworkPolicy {} lets the workers' pods reach Redis on {listens}",
            np["metadata"]["name"]
        );
    }

    // Service links: NAME_SERVICE_HOST, NAME_SERVICE_PORT[_PORTNAME], NAME_PORT[_...].
    let corral_vars: Vec<&str> = help()
        .split("[env: ")
        .skip(1)
        .filter_map(|s| s.split('=').next())
        .collect();
    assert!(corral_vars.contains(&"CORRAL_REDIS"), "{corral_vars:?}");
    if workers["spec"]["enableServiceLinks"] != false {
        for s in docs(m, "Service") {
            let prefix = s["metadata"]["name"]
                .as_str()
                .unwrap()
                .to_ascii_uppercase()
                .replace('-', "_");
            for var in &corral_vars {
                assert!(
                    !(var.starts_with(&format!("{prefix}_SERVICE_"))
                        || *var == format!("{prefix}_PORT")
                        || var.starts_with(&format!("{prefix}_PORT_"))),
                    "Service {} puts {var} into the sidecar's environment",
                    s["metadata"]["name"]
                );
            }
        }
    }
}

/// Redis: one instance, nothing persisted, as non-root and restricted as the sidecars, probed.
#[test]
fn fleet_redis_is_one_disposable_restricted_instance() {
    let Some(m) = fleet_manifests() else { return };
    let (_, redis) = fleet_redis(m);
    assert_eq!(redis["apiVersion"], "apps/v1");
    let spec = &redis["spec"];
    assert_eq!(
        spec["replicas"].as_u64().unwrap_or(1),
        1,
        "one Redis: two behind the Service would each hand out the whole limit"
    );
    assert_eq!(
        spec["strategy"]["type"], "Recreate",
        "a rolling update runs two Redis at once"
    );
    let template = &spec["template"];
    assert!(
        selects(
            &spec["selector"]["matchLabels"],
            &template["metadata"]["labels"]
        ),
        "the Deployment's selector matches its pods"
    );
    let pod = &template["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_restricted(pod);
    let (c, listens) = redis_container(pod);
    let image = c["image"].as_str().expect("image");
    assert!(image.starts_with("redis:7"), "image {image}");
    let uid = if c["securityContext"].get("runAsUser").is_some() {
        &c["securityContext"]["runAsUser"]
    } else {
        &pod["securityContext"]["runAsUser"]
    };
    assert_eq!(uid, 999, "the redis image's own user");

    // Disposable buckets: no RDB snapshots, no append-only file.
    let args: Vec<String> = serde_json::from_value(c["args"].clone()).unwrap();
    assert_eq!(
        flag_value(&args, "--save"),
        Some(""),
        "--save \"\": {args:?}"
    );
    assert_eq!(flag_value(&args, "--appendonly"), Some("no"), "{args:?}");

    // Probes reach redis-server: its port, or redis-cli ping.
    for probe in ["readinessProbe", "livenessProbe"] {
        let p = &c[probe];
        if let Some(tcp) = p.get("tcpSocket") {
            assert_eq!(port_number(&c, &tcp["port"]), listens, "{probe} port");
        } else {
            let command: Vec<String> = serde_json::from_value(p["exec"]["command"].clone())
                .unwrap_or_else(|_| panic!("{probe}: tcpSocket or exec: {p}"));
            assert!(
                command.first().is_some_and(|c| c == "redis-cli")
                    && command.iter().any(|a| a.eq_ignore_ascii_case("ping")),
                "{probe}: {command:?}"
            );
        }
    }
}

/// The fleet's corral.toml passes `check-config`, which prints its [fleet] section, and sets
/// the limit the replicas share.
#[test]
fn fleet_config_passes_check_config_with_its_fleet_section() {
    let Some(m) = fleet_manifests() else { return };
    let (text, config) = sidecar_config(m);
    let path = temp_config("fleet-check", &text);
    let key = "sk-deploy-fleet-check";
    let printed = check_config(&path, &[("OPENAI_API_KEY", key)]);
    let _ = std::fs::remove_file(&path);
    assert!(
        !printed.contains(key),
        "check-config hides the key:\n{printed}"
    );
    assert!(
        printed.contains("\n[fleet]\n"),
        "check-config prints [fleet]:\n{printed}"
    );
    let effective: toml::Value = toml::from_str(&printed).expect("check-config prints TOML");
    let fleet = effective.get("fleet").expect("[fleet]");
    let redis = config["fleet"]
        .get("redis")
        .and_then(toml::Value::as_str)
        .expect("[fleet] redis in the ConfigMap");
    assert_eq!(
        fleet.get("redis").and_then(toml::Value::as_str),
        Some(redis)
    );
    assert_eq!(
        fleet.get("name").and_then(toml::Value::as_str),
        Some("llm-eval"),
        "{printed}"
    );
    // The limit is set once, in the config every replica reads.
    for up in effective["upstream"].as_array().expect("upstreams") {
        for limit in ["rpm", "tpm"] {
            assert!(
                up["limits"]
                    .get(limit)
                    .and_then(toml::Value::as_integer)
                    .is_some(),
                "upstream {}: limits.{limit} for the fleet to share",
                up["name"]
            );
        }
    }
}

/// Run as the sidecar runs it, with the Redis it names unreachable: corral serves `/healthz`
/// and `/readyz` at once, with the fleet configured, and a request goes through on the local
/// share, corral reporting the fallback.
#[tokio::test]
async fn fleet_sidecar_serves_while_redis_is_unreachable() {
    let Some(m) = fleet_manifests() else { return };
    let (text, config) = sidecar_config(m);
    let upstream = support::MockUpstream::start(|_| async {
        support::json(
            200,
            serde_json::json!({"id": "chatcmpl-fleet", "object": "chat.completion", "choices": []}),
        )
    })
    .await;
    let base_url = config["upstream"][0]["base_url"].as_str().unwrap();
    let text = text.replace(base_url, &upstream.url("/v1"));
    let path = temp_config("fleet-run", &text);
    let unreachable = "redis://127.0.0.1:1/0";
    let args: Vec<String> = [
        "--config",
        path.to_str().unwrap(),
        "--log-format",
        "json",
        "--admin-listen",
        "127.0.0.1:0",
        "--redis",
        unreachable,
    ]
    .map(String::from)
    .to_vec();
    let key = "sk-deploy-fleet-run";
    let env = [("OPENAI_API_KEY", key), ("CORRAL_LISTEN", "127.0.0.1:0")];
    let started = std::time::Instant::now();
    let corral = start(&args, &env, true).await;
    let admin = corral.admin.expect("admin listener");
    assert_eq!(corral.get(admin, "/healthz").await, (200, "ok\n".into()));
    assert_eq!(corral.get(admin, "/readyz").await, (200, "ready\n".into()));
    let ready = started.elapsed();
    assert!(
        ready < WITHOUT_REDIS,
        "ready after {ready:?} with Redis unreachable"
    );
    let status = |body: String| -> Value { serde_json::from_str(&body).expect("/status JSON") };
    let fleet = status(corral.get(admin, "/status").await.1)["fleet"].clone();
    assert_eq!(fleet["redis"], unreachable, "--redis applies: {fleet}");
    assert_eq!(fleet["name"], "llm-eval", "{fleet}");

    let request = support::post(
        &corral.url("/v1/chat/completions"),
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#,
    );
    let (parts, _) =
        tokio::time::timeout(WITHOUT_REDIS, support::send(&support::client(), request))
            .await
            .expect("a request is answered without Redis");
    assert_eq!(parts.status, 200);
    assert_eq!(
        upstream.last().headers["authorization"],
        format!("Bearer {key}").as_str()
    );
    let deadline = tokio::time::Instant::now() + WITHOUT_REDIS;
    let mut mode = Value::Null;
    while tokio::time::Instant::now() < deadline {
        mode = status(corral.get(admin, "/status").await.1)["fleet"]["mode"].clone();
        if mode == "fallback" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(mode, "fallback", "corral reports pacing on its own share");
    let _ = std::fs::remove_file(&path);
}
