//! The agent as a container: its base images made from Debian's archive, the runtime image
//! from a host-built binary (the runtime stage of `deploy/Dockerfile`), and the DaemonSet's
//! pod spec turned into `podman run` flags, field by field.
//!
//! Guarantees: the translation reads `deploy/daemonset.yaml` itself and fails on any field it
//! does not know, so a new field in the manifest cannot silently go untested; every package of
//! a base image is pinned to an exact version; nothing is pulled from a registry.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use serde_yaml::Value;

use crate::{Error, Result, checked_output};

/// The container engine (Debian's podman; `SKEWLESS_ENGINE=docker` elsewhere).
#[must_use]
pub fn engine() -> String {
    std::env::var("SKEWLESS_ENGINE").unwrap_or_else(|_| "podman".to_owned())
}

/// A command of the engine. podman runs containers with runc: crun refuses these machines'
/// hybrid cgroup layout.
#[must_use]
pub fn engine_cmd() -> Command {
    let engine = engine();
    let mut cmd = Command::new(&engine);
    if engine == "podman" {
        cmd.args(["--runtime", "runc"]);
    }
    cmd
}

/// The Debian suite the base images come from.
pub const SUITE: &str = "bookworm";

/// The runtime base: glibc and libgcc (what the agent's binary links), nothing else.
pub const RUNTIME_PACKAGES: &[(&str, &str)] = &[
    ("libc6", "2.36-9+deb12u14"),
    ("libgcc-s1", "12.2.0-14+deb12u1"),
];

/// The build base: Debian's rustc-web (user space and eBPF), its prebuilt `core` for
/// bpfel-unknown-none, a C toolchain for the crates that build C, CA certificates for the
/// crate registry.
pub const BUILD_PACKAGES: &[(&str, &str)] = &[
    ("rustc-web", "1.96.0+dfsg1-1~deb12u2"),
    ("cargo-web", "1.96.0+dfsg1-1~deb12u2"),
    ("libstd-rust-web-dev-bpf", "1.96.0+dfsg1-1~deb12u2"),
    ("gcc", "4:12.2.0-3"),
    ("libc6-dev", "2.36-9+deb12u14"),
    ("binutils", "2.40-2"),
    ("ca-certificates", "20230311+deb12u1"),
];

/// Paths a runtime image leaves out: documentation, translations, iconv modules.
const EXCLUDED: &[&str] = &[
    "/usr/share/doc/*",
    "/usr/share/locale/*",
    "/usr/share/man/*",
    "/usr/share/lintian/*",
    "/usr/lib/*/gconv/*",
];

/// Where the Debian packages come from and what the build trusts.
#[derive(Clone, Debug, Default)]
pub struct BaseOptions {
    /// A Debian mirror URL; default: this machine's own apt sources.
    pub mirror: Option<String>,
    /// An extra CA certificate (PEM) for the mirror and the crate registry.
    pub ca_cert: Option<PathBuf>,
    /// A cargo config (a crate source replacement, a registry mirror) for the build base.
    pub cargo_config: Option<PathBuf>,
}

/// Which base image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    Runtime,
    Build,
}

impl Base {
    fn packages(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Base::Runtime => RUNTIME_PACKAGES,
            Base::Build => BUILD_PACKAGES,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Base::Runtime => "skewless-runtime-base",
            Base::Build => "skewless-build-base",
        }
    }
}

/// The tag of a base image: its name and a digest of everything that goes into it.
fn base_tag(base: Base, opts: &BaseOptions) -> String {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (SUITE, base.packages(), EXCLUDED, &opts.mirror).hash(&mut h);
    for file in [&opts.ca_cert, &opts.cargo_config].into_iter().flatten() {
        std::fs::read(file).unwrap_or_default().hash(&mut h);
    }
    format!(
        "localhost/{}:{SUITE}-{:012x}",
        base.name(),
        h.finish() & 0xffff_ffff_ffff
    )
}

/// Whether the engine has image `tag`.
#[must_use]
pub fn image_exists(tag: &str) -> bool {
    engine_cmd()
        .args(["image", "inspect", tag])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Makes the base image with mmdebstrap from Debian's archive (once: its tag names its
/// inputs) and returns its tag.
///
/// # Errors
/// When mmdebstrap or the engine fails (a pinned version the mirror no longer has, too).
pub fn base_image(base: Base, opts: &BaseOptions) -> Result<String> {
    let tag = base_tag(base, opts);
    if image_exists(&tag) {
        return Ok(tag);
    }
    let dir = tempdir("skewless-base")?;
    let tar = dir.join("rootfs.tar");
    let mut cmd = Command::new("mmdebstrap");
    cmd.arg(match base {
        // Files only: no shell, no dpkg, no maintainer scripts.
        Base::Runtime => "--variant=extract",
        // Essential (a shell and coreutils for the Dockerfile's RUN lines) and the toolchain.
        Base::Build => "--variant=essential",
    });
    let include: Vec<String> = base
        .packages()
        .iter()
        .map(|(p, v)| format!("{p}={v}"))
        .collect();
    cmd.arg(format!("--include={}", include.join(",")));
    if base == Base::Runtime {
        for path in EXCLUDED {
            cmd.arg(format!("--dpkgopt=path-exclude={path}"));
        }
    }
    if let Some(ca) = &opts.ca_cert {
        // apt in mmdebstrap trusts it, and so does everything in the build base.
        cmd.arg(format!(
            "--aptopt=Acquire::https::CaInfo \"{}\"",
            ca.display()
        ));
        if base == Base::Build {
            cmd.arg(format!(
                "--customize-hook=copy-in {} /usr/local/share/ca-certificates/",
                ca.display()
            ));
            cmd.arg("--customize-hook=chroot \"$1\" update-ca-certificates");
        }
    }
    if let (Some(config), Base::Build) = (&opts.cargo_config, base) {
        cmd.arg("--customize-hook=mkdir -p \"$1/cargo\"");
        cmd.arg(format!(
            "--customize-hook=copy-in {} /cargo/",
            config.display()
        ));
    }
    cmd.arg(SUITE).arg(&tar);
    match &opts.mirror {
        Some(url) => {
            cmd.arg(format!("deb {url} {SUITE} main"));
        }
        None => {
            cmd.arg(host_apt_sources()?);
        }
    }
    let built = checked_output(&mut cmd);
    let imported =
        built.and_then(|_| checked_output(engine_cmd().arg("import").arg(&tar).arg(&tag)));
    let _ = std::fs::remove_dir_all(&dir);
    imported.map(|_| tag)
}

/// This machine's apt sources file (deb822 or one-line format), for mmdebstrap.
fn host_apt_sources() -> Result<PathBuf> {
    let dir = Path::new("/etc/apt/sources.list.d");
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "sources" || e == "list"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    let list = Path::new("/etc/apt/sources.list");
    if list.is_file() && std::fs::metadata(list).is_ok_and(|m| m.len() > 0) {
        found.insert(0, list.to_owned());
    }
    found.into_iter().next().ok_or_else(|| {
        Error::Invalid(
            "/etc/apt".to_owned(),
            "no apt sources on this machine: pass a Debian mirror",
        )
    })
}

/// The runtime stage of `dockerfile` (from its `FROM ${RUNTIME_BASE} AS runtime` line),
/// with its `COPY --from=dist` reading from the build context instead.
///
/// # Errors
/// When the Dockerfile has no such stage.
pub fn runtime_stage(dockerfile: &str) -> Result<String> {
    let start = dockerfile
        .find("FROM ${RUNTIME_BASE} AS runtime")
        .ok_or_else(|| {
            Error::Invalid(
                "deploy/Dockerfile".to_owned(),
                "no `FROM ${RUNTIME_BASE} AS runtime` stage",
            )
        })?;
    Ok(format!(
        "ARG RUNTIME_BASE\n{}",
        dockerfile[start..].replace("COPY --from=dist ", "COPY ")
    ))
}

/// Builds image `tag` from a host-built agent binary: the runtime stage of
/// `deploy/Dockerfile` on the runtime base, with the binary stripped of its debug info.
///
/// # Errors
/// When stripping, the base image or the engine's build fails.
pub fn runtime_image(binary: &Path, tag: &str, opts: &BaseOptions) -> Result<()> {
    let base = base_image(Base::Runtime, opts)?;
    let dockerfile = repo_root().join("deploy/Dockerfile");
    let text = std::fs::read_to_string(&dockerfile).map_err(|source| Error::Io {
        path: dockerfile.clone(),
        source,
    })?;
    let dir = tempdir("skewless-image")?;
    let result = (|| {
        std::fs::write(dir.join("Containerfile"), runtime_stage(&text)?).map_err(|source| {
            Error::Io {
                path: dir.clone(),
                source,
            }
        })?;
        checked_output(
            Command::new("objcopy")
                .args(["--strip-debug", "--strip-unneeded"])
                .arg(binary)
                .arg(dir.join("skewless")),
        )?;
        checked_output(
            engine_cmd()
                .args(["build", "--pull=never", "--build-arg"])
                .arg(format!("RUNTIME_BASE={base}"))
                .args(["-t", tag, "-f"])
                .arg(dir.join("Containerfile"))
                .arg(&dir),
        )
        .map(drop)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The size of image `tag` in bytes, as the engine reports it.
///
/// # Errors
/// When the engine does not know the image.
pub fn image_size(tag: &str) -> Result<u64> {
    let out = checked_output(
        engine_cmd()
            .args(["image", "inspect", "--format", "{{.Size}}"])
            .arg(tag),
    )?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| Error::Invalid(tag.to_owned(), "the engine reported no size"))
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tempdir(prefix: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        crate::builder::unique_id()
    ));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// A probe of the pod spec: an HTTP GET of `path` on `port` (a container port number).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpProbe {
    pub path: String,
    pub port: u16,
    pub period: Duration,
    pub failure_threshold: u32,
    pub initial_delay: Duration,
}

/// What the container runtime needs from the DaemonSet's pod spec, read field by field.
#[derive(Clone, Debug, Default)]
pub struct PodSpec {
    /// `podman run` flags, in the order the fields were read.
    pub flags: Vec<String>,
    /// The container's arguments, `$(VAR)` expanded from its environment.
    pub args: Vec<String>,
    pub readiness: Option<HttpProbe>,
    pub liveness: Option<HttpProbe>,
    /// `terminationGracePeriodSeconds`.
    pub grace: Duration,
    /// The pod runs with a service account: the API credentials the kubelet would mount.
    pub service_account: Option<String>,
}

/// What the test environment supplies for the pod spec's node-specific parts.
#[derive(Clone, Debug)]
pub struct Node<'a> {
    /// The network namespace standing for the host's (`hostNetwork: true`).
    pub netns: &'a str,
    /// `spec.nodeName` for the downward API.
    pub name: &'a str,
    /// hostPath `path` -> the directory to mount instead (e.g. the host's cgroup root ->
    /// the testbed's cgroup directory). A hostPath not listed is an error.
    pub host_paths: BTreeMap<String, PathBuf>,
}

/// Fails with the path of an unknown field.
fn known(map: &Value, at: &str, fields: &[&str]) -> Result<()> {
    let Some(m) = map.as_mapping() else {
        return Err(Error::Invalid(at.to_owned(), "expected a mapping"));
    };
    for k in m.keys() {
        let k = k.as_str().unwrap_or_default();
        if !fields.contains(&k) {
            return Err(Error::Invalid(
                format!("{at}.{k}"),
                "a pod spec field the container translation does not know: translate it",
            ));
        }
    }
    Ok(())
}

fn str_at<'v>(v: &'v Value, at: &str) -> Result<&'v str> {
    v.as_str()
        .ok_or_else(|| Error::Invalid(at.to_owned(), "expected a string"))
}

/// Kubernetes quantity of memory (`64Mi`, `1Gi`) in bytes.
fn memory_bytes(q: &str, at: &str) -> Result<u64> {
    let (n, mult) = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)]
        .iter()
        .find_map(|(s, m)| q.strip_suffix(s).map(|n| (n, *m)))
        .unwrap_or((q, 1));
    n.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| Error::Invalid(format!("{at}: {q}"), "not a memory quantity"))
}

/// Kubernetes CPU quantity (`100m`, `1`) in millicores.
fn millicores(q: &str, at: &str) -> Result<u64> {
    match q.strip_suffix('m') {
        Some(m) => m.parse().ok(),
        None => q.parse::<u64>().ok().map(|c| c * 1000),
    }
    .ok_or_else(|| Error::Invalid(format!("{at}: {q}"), "not a CPU quantity"))
}

/// A container's `resources:`, CPU in millicores and memory in bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Resources {
    requests_cpu: Option<u64>,
    requests_memory: Option<u64>,
    limits_memory: Option<u64>,
}

impl Resources {
    fn of(res: &Value, at: &str) -> Result<Self> {
        known(res, at, &["requests", "limits"])?;
        known(
            &res["requests"],
            &format!("{at}.requests"),
            &["cpu", "memory"],
        )?;
        known(&res["limits"], &format!("{at}.limits"), &["memory"])?;
        let q = |v: &Value, f: fn(&str, &str) -> Result<u64>, at: &str| {
            v.as_str().map(|s| f(s, at)).transpose()
        };
        Ok(Self {
            requests_cpu: q(&res["requests"]["cpu"], millicores, "requests.cpu")?,
            requests_memory: q(&res["requests"]["memory"], memory_bytes, "requests.memory")?,
            limits_memory: q(&res["limits"]["memory"], memory_bytes, "limits.memory")?,
        })
    }

    /// What the kubelet puts in an env var with a resourceFieldRef: the quantity divided by
    /// `divisor`, rounded up; an unset limit reads as the node's allocatable amount (here,
    /// the machine's CPUs and memory), an unset request as 0.
    fn env_value(&self, resource: &str, divisor: &str, at: &str) -> Result<String> {
        let (value, divisor) = match resource {
            "requests.cpu" => (self.requests_cpu.unwrap_or(0), millicores(divisor, at)?),
            "limits.cpu" => (node_millicores(), millicores(divisor, at)?),
            "requests.memory" => (
                self.requests_memory.unwrap_or(0),
                memory_bytes(divisor, at)?,
            ),
            "limits.memory" => (
                self.limits_memory.unwrap_or_else(node_memory_bytes),
                memory_bytes(divisor, at)?,
            ),
            _ => {
                return Err(Error::Invalid(
                    format!("{at}.resource: {resource}"),
                    "a resource the translation does not know",
                ));
            }
        };
        if divisor == 0 {
            return Err(Error::Invalid(at.to_owned(), "a zero divisor"));
        }
        Ok(value.div_ceil(divisor).to_string())
    }
}

fn node_millicores() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64) * 1000
}

fn node_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

impl PodSpec {
    /// Reads the pod template of the DaemonSet in `yaml` and translates it for `node`.
    ///
    /// # Errors
    /// On any field the translation does not know, and on values it cannot honour.
    #[expect(clippy::too_many_lines, reason = "one arm per field of the pod spec")]
    pub fn from_daemonset(yaml: &str, node: &Node<'_>) -> Result<Self> {
        let ds: Value = serde_yaml::from_str(yaml)
            .map_err(|_| Error::Invalid("daemonset".to_owned(), "not YAML"))?;
        let pod = &ds["spec"]["template"]["spec"];
        known(
            pod,
            "spec.template.spec",
            &[
                "serviceAccountName",
                "hostNetwork",
                "dnsPolicy",
                "terminationGracePeriodSeconds",
                "priorityClassName",
                "tolerations",
                "containers",
                "volumes",
            ],
        )?;
        let mut spec = PodSpec::default();
        let flags = &mut spec.flags;
        if pod["hostNetwork"].as_bool() != Some(true) {
            return Err(Error::Invalid(
                "spec.template.spec.hostNetwork".to_owned(),
                "the translation runs host-network pods only",
            ));
        }
        flags.push(format!("--network=ns:/run/netns/{}", node.netns));
        // dnsPolicy ClusterFirstWithHostNet: the agent resolves no names (the API server by
        // address); priorityClassName and tolerations only decide scheduling.
        spec.grace =
            Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30));
        flags.push(format!("--stop-timeout={}", spec.grace.as_secs()));
        spec.service_account = pod["serviceAccountName"].as_str().map(str::to_owned);
        let containers = pod["containers"]
            .as_sequence()
            .map_or(&[][..], Vec::as_slice);
        let [c] = containers else {
            return Err(Error::Invalid(
                "spec.template.spec.containers".to_owned(),
                "exactly one container",
            ));
        };
        let at = "containers[0]";
        known(
            c,
            at,
            &[
                "name",
                "image",
                "imagePullPolicy",
                "args",
                "env",
                "ports",
                "readinessProbe",
                "livenessProbe",
                "resources",
                "securityContext",
                "volumeMounts",
            ],
        )?;
        // image and imagePullPolicy: the caller runs its own image, never pulled.
        flags.push("--pull=never".to_owned());
        let container_name = str_at(&c["name"], &format!("{at}.name"))?.to_owned();
        let resources = Resources::of(&c["resources"], &format!("{at}.resources"))?;
        let mut env = BTreeMap::new();
        for (i, e) in c["env"].as_sequence().into_iter().flatten().enumerate() {
            let at = format!("{at}.env[{i}]");
            known(e, &at, &["name", "value", "valueFrom"])?;
            let name = str_at(&e["name"], &at)?.to_owned();
            let value = if let Some(v) = e["value"].as_str() {
                v.to_owned()
            } else if !e["valueFrom"]["resourceFieldRef"].is_null() {
                let at = format!("{at}.valueFrom.resourceFieldRef");
                let r = &e["valueFrom"]["resourceFieldRef"];
                known(r, &at, &["containerName", "resource", "divisor"])?;
                if r["containerName"]
                    .as_str()
                    .is_some_and(|n| n != container_name)
                {
                    return Err(Error::Invalid(at, "another container's resources"));
                }
                resources.env_value(
                    str_at(&r["resource"], &at)?,
                    r["divisor"].as_str().unwrap_or("1"),
                    &at,
                )?
            } else {
                known(
                    &e["valueFrom"],
                    &format!("{at}.valueFrom"),
                    &["fieldRef", "resourceFieldRef"],
                )?;
                let field = &e["valueFrom"]["fieldRef"];
                known(field, &format!("{at}.valueFrom.fieldRef"), &["fieldPath"])?;
                match field["fieldPath"].as_str() {
                    Some("spec.nodeName") => node.name.to_owned(),
                    _ => {
                        return Err(Error::Invalid(
                            format!("{at}.valueFrom.fieldRef.fieldPath"),
                            "only spec.nodeName is translated",
                        ));
                    }
                }
            };
            flags.push(format!("--env={name}={value}"));
            env.insert(name, value);
        }
        for (i, a) in c["args"].as_sequence().into_iter().flatten().enumerate() {
            let mut arg = str_at(a, &format!("{at}.args[{i}]"))?.to_owned();
            for (k, v) in &env {
                arg = arg.replace(&format!("$({k})"), v);
            }
            spec.args.push(arg);
        }
        let mut ports = BTreeMap::new();
        for (i, p) in c["ports"].as_sequence().into_iter().flatten().enumerate() {
            let at = format!("{at}.ports[{i}]");
            known(p, &at, &["name", "containerPort", "protocol"])?;
            // With host networking a containerPort only names a port of the host's.
            let port = p["containerPort"]
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .ok_or_else(|| Error::Invalid(at.clone(), "containerPort"))?;
            if let Some(name) = p["name"].as_str() {
                ports.insert(name.to_owned(), port);
            }
        }
        let probe = |v: &Value, at: &str| -> Result<Option<HttpProbe>> {
            if v.is_null() {
                return Ok(None);
            }
            known(
                v,
                at,
                &[
                    "httpGet",
                    "periodSeconds",
                    "failureThreshold",
                    "initialDelaySeconds",
                ],
            )?;
            known(&v["httpGet"], &format!("{at}.httpGet"), &["path", "port"])?;
            let get = &v["httpGet"];
            let port = match &get["port"] {
                Value::String(name) => ports.get(name).copied(),
                Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
                _ => None,
            }
            .ok_or_else(|| Error::Invalid(format!("{at}.httpGet.port"), "no such port"))?;
            Ok(Some(HttpProbe {
                path: str_at(&get["path"], &format!("{at}.httpGet.path"))?.to_owned(),
                port,
                period: Duration::from_secs(v["periodSeconds"].as_u64().unwrap_or(10)),
                failure_threshold: v["failureThreshold"].as_u64().unwrap_or(3) as u32,
                initial_delay: Duration::from_secs(v["initialDelaySeconds"].as_u64().unwrap_or(0)),
            }))
        };
        spec.readiness = probe(&c["readinessProbe"], &format!("{at}.readinessProbe"))?;
        spec.liveness = probe(&c["livenessProbe"], &format!("{at}.livenessProbe"))?;
        if let Some(cpu) = resources.requests_cpu {
            // The kubelet's cpu.shares for a request: 1024 per core.
            flags.push(format!("--cpu-shares={}", (cpu * 1024 / 1000).max(2)));
        }
        if let Some(mem) = resources.requests_memory {
            flags.push(format!("--memory-reservation={mem}"));
        }
        if let Some(mem) = resources.limits_memory {
            flags.push(format!("--memory={mem}"));
        }
        let sc = &c["securityContext"];
        let at_sc = format!("{at}.securityContext");
        known(
            sc,
            &at_sc,
            &[
                "runAsUser",
                "privileged",
                "allowPrivilegeEscalation",
                "readOnlyRootFilesystem",
                "seccompProfile",
                "capabilities",
            ],
        )?;
        if let Some(uid) = sc["runAsUser"].as_u64() {
            flags.push(format!("--user={uid}"));
        }
        if sc["privileged"].as_bool() == Some(true) {
            flags.push("--privileged".to_owned());
        }
        if sc["allowPrivilegeEscalation"].as_bool() == Some(false) {
            flags.push("--security-opt=no-new-privileges".to_owned());
        }
        if sc["readOnlyRootFilesystem"].as_bool() == Some(true) {
            // As the kubelet: read-only, with no tmpfs of the runtime's own on top.
            flags.push("--read-only".to_owned());
            flags.push("--read-only-tmpfs=false".to_owned());
        }
        known(
            &sc["seccompProfile"],
            &format!("{at_sc}.seccompProfile"),
            &["type"],
        )?;
        match sc["seccompProfile"]["type"].as_str() {
            Some("Unconfined") => flags.push("--security-opt=seccomp=unconfined".to_owned()),
            // The engine's default profile is the runtime's default.
            Some("RuntimeDefault") | None => {}
            Some(_) => {
                return Err(Error::Invalid(
                    format!("{at_sc}.seccompProfile.type"),
                    "only Unconfined and RuntimeDefault are translated",
                ));
            }
        }
        let caps = &sc["capabilities"];
        known(caps, &format!("{at_sc}.capabilities"), &["drop", "add"])?;
        for cap in caps["drop"].as_sequence().into_iter().flatten() {
            let cap = str_at(cap, "capabilities.drop")?;
            flags.push(format!(
                "--cap-drop={}",
                if cap == "ALL" {
                    "all".to_owned()
                } else {
                    format!("CAP_{cap}")
                }
            ));
        }
        for cap in caps["add"].as_sequence().into_iter().flatten() {
            flags.push(format!(
                "--cap-add=CAP_{}",
                str_at(cap, "capabilities.add")?
            ));
        }
        let mut volumes = BTreeMap::new();
        for (i, v) in pod["volumes"]
            .as_sequence()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let at = format!("spec.template.spec.volumes[{i}]");
            known(v, &at, &["name", "hostPath", "emptyDir"])?;
            volumes.insert(str_at(&v["name"], &at)?.to_owned(), (at, v));
        }
        for (i, m) in c["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let at = format!("{at}.volumeMounts[{i}]");
            known(m, &at, &["name", "mountPath", "readOnly"])?;
            let path = str_at(&m["mountPath"], &at)?;
            let ro = m["readOnly"].as_bool() == Some(true);
            let (vat, v) = volumes
                .get(str_at(&m["name"], &at)?)
                .ok_or_else(|| Error::Invalid(at.clone(), "no such volume"))?;
            if !v["hostPath"].is_null() {
                known(
                    &v["hostPath"],
                    &format!("{vat}.hostPath"),
                    &["path", "type"],
                )?;
                let host = str_at(&v["hostPath"]["path"], vat)?;
                let dir = node.host_paths.get(host).ok_or_else(|| {
                    Error::Invalid(
                        format!("{vat}.hostPath.path: {host}"),
                        "the test environment maps no directory for this host path",
                    )
                })?;
                flags.push(format!(
                    "--volume={}:{path}{}",
                    dir.display(),
                    if ro { ":ro" } else { "" }
                ));
            } else {
                known(
                    &v["emptyDir"],
                    &format!("{vat}.emptyDir"),
                    &["medium", "sizeLimit"],
                )?;
                if v["emptyDir"]["medium"].as_str() != Some("Memory") {
                    return Err(Error::Invalid(
                        format!("{vat}.emptyDir.medium"),
                        "only Memory (a tmpfs) is translated",
                    ));
                }
                let size = match v["emptyDir"]["sizeLimit"].as_str() {
                    Some(q) => format!(",size={}", memory_bytes(q, "sizeLimit")?),
                    None => String::new(),
                };
                flags.push(format!("--tmpfs={path}:rw{size}"));
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Node<'static> {
        Node {
            netns: "sktb-x-node0",
            name: "node-a",
            host_paths: BTreeMap::from([("/sys/fs/cgroup".to_owned(), PathBuf::from("/tmp/cg"))]),
        }
    }

    fn daemonset() -> String {
        std::fs::read_to_string(repo_root().join("deploy/daemonset.yaml")).unwrap()
    }

    #[test]
    fn the_shipped_daemonset_translates_field_by_field() {
        let spec = PodSpec::from_daemonset(&daemonset(), &node()).unwrap();
        for flag in [
            "--network=ns:/run/netns/sktb-x-node0",
            "--user=0",
            "--security-opt=no-new-privileges",
            "--read-only",
            "--cap-drop=all",
            "--cap-add=CAP_BPF",
            "--cap-add=CAP_NET_ADMIN",
            "--volume=/tmp/cg:/run/skewless/cgroup:ro",
            "--env=NODE_NAME=node-a",
            // resourceFieldRef: requests.cpu in millicores, memory in bytes, as the kubelet.
            "--env=SKEWLESS_CPU_REQUEST_MILLICORES=100",
            "--env=SKEWLESS_MEMORY_REQUEST_BYTES=67108864",
            "--env=SKEWLESS_MEMORY_LIMIT_BYTES=268435456",
        ] {
            assert!(
                spec.flags.iter().any(|f| f == flag),
                "{flag} in {:?}",
                spec.flags
            );
        }
        assert!(
            spec.args.contains(&"--node-name=node-a".to_owned()),
            "$(NODE_NAME) expanded: {:?}",
            spec.args
        );
        assert_eq!(
            spec.readiness.as_ref().map(|p| p.path.as_str()),
            Some("/ready")
        );
        assert_eq!(spec.liveness.as_ref().map(|p| p.port), Some(9990));
    }

    #[test]
    fn an_unknown_field_or_unmapped_host_path_fails_the_translation() {
        let with_field = daemonset().replace(
            "          readinessProbe:",
            "          startupProbe:\n            httpGet: {path: /live, port: metrics}\n          readinessProbe:",
        );
        let err = PodSpec::from_daemonset(&with_field, &node())
            .unwrap_err()
            .to_string();
        assert!(err.contains("startupProbe"), "{err}");
        let no_paths = Node {
            host_paths: BTreeMap::new(),
            ..node()
        };
        let err = PodSpec::from_daemonset(&daemonset(), &no_paths)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/sys/fs/cgroup"), "{err}");
    }

    #[test]
    fn the_runtime_stage_reads_the_binary_from_the_context() {
        let text = std::fs::read_to_string(repo_root().join("deploy/Dockerfile")).unwrap();
        let stage = runtime_stage(&text).unwrap();
        assert!(
            stage.starts_with("ARG RUNTIME_BASE\nFROM ${RUNTIME_BASE} AS runtime"),
            "{stage}"
        );
        assert!(
            stage.contains("COPY /skewless /usr/bin/skewless"),
            "{stage}"
        );
        assert!(!stage.contains("--from="), "{stage}");
    }
}
