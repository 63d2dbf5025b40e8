//! `[lerobot]`: LeRobot's gRPC service, its caps and deadlines, and the `[[lerobot.serve]]`
//! names a `robot_client` may ask for.

use serde::Deserialize;

use super::{ConfigError, Keys, PolicySpec, invalid};

/// `[lerobot]`: LeRobot's `AsyncInference` gRPC service for its unmodified `robot_client`
/// (see docs/lerobot.md). Plaintext and unauthenticated like LeRobot's own server, so it is off
/// unless the section is there, and `allow` can restrict who may connect.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLerobot {
    pub(super) listen: Option<String>,
    pub(super) allow: Vec<String>,
    pub(super) long_poll_ms: Option<u64>,
    pub(super) max_payload_bytes: Option<usize>,
    pub(super) resize: Option<String>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_connections_per_peer: Option<usize>,
    pub(super) handshake_timeout_s: Option<f64>,
    pub(super) idle_timeout_s: Option<f64>,
    pub(super) chunk_timeout_s: Option<f64>,
    pub(super) observation_timeout_s: Option<f64>,
    pub(super) takeover_after_s: Option<f64>,
    pub(super) owner_grace_s: Option<f64>,
    pub(super) serve: Vec<RawLerobotServe>,
}

/// `[[lerobot.serve]]`: a name the client may send as `pretrained_name_or_path`, and the
/// served policy it means.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLerobotServe {
    pub(super) pretrained: String,
    pub(super) policy: Option<String>,
    pub(super) policy_type: Option<String>,
}

/// `[lerobot]`: LeRobot's `AsyncInference` gRPC service (docs/lerobot.md).
#[derive(Clone, Debug, PartialEq)]
pub struct LerobotConfig {
    /// `listen`: its own address (LeRobot's clients default to port 8080).
    pub listen: std::net::SocketAddr,
    /// `allow`: peers that may connect (addresses or CIDR networks); empty allows all.
    pub allow: Vec<ipnet::IpNet>,
    /// `long_poll_ms`: how long `GetActions` waits for a chunk before answering "none yet"
    /// (LeRobot's server: 2000).
    pub long_poll: std::time::Duration,
    /// `max_payload_bytes`: the largest reassembled observation or config accepted.
    pub max_payload_bytes: usize,
    /// `resize`: what a camera frame of another size than the policy's input gets.
    pub resize: LerobotResize,
    /// `max_connections`: gRPC connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// `max_connections_per_peer`: of those, how many one peer address may hold.
    pub max_connections_per_peer: usize,
    /// `handshake_timeout_s`: time from accept to the HTTP/2 connection preface, and from the
    /// preface to the first call.
    pub handshake_timeout: std::time::Duration,
    /// `idle_timeout_s`: a connection with no call in progress for this long is closed.
    pub idle_timeout: std::time::Duration,
    /// `chunk_timeout_s`: the longest wait for an observation's next chunk (the first included).
    pub chunk_timeout: std::time::Duration,
    /// `observation_timeout_s`: the longest one observation may take to arrive whole.
    pub observation_timeout: std::time::Duration,
    /// `takeover_after_s`: how long the session's owner must be silent before another
    /// connection may take the session over.
    pub takeover_after: std::time::Duration,
    /// `owner_grace_s`: after the owner's last call, how long only the owner's address may
    /// claim the session (a robot that lost its channel gets its session back).
    pub owner_grace: std::time::Duration,
    /// `[[lerobot.serve]]`: the names a client may ask for, and the policy each means.
    pub serve: Vec<LerobotServe>,
}

/// How camera frames whose size differs from the policy's input are handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LerobotResize {
    /// Bilinear, half-pixel centres, no antialiasing, on uint8: what LeRobot 0.6.1's server
    /// does (`F.interpolate(mode="bilinear", align_corners=False)`).
    Bilinear,
    /// Refuse the policy setup: the client must send frames at the policy's resolution
    /// (the upstream resize is disputed: lerobot#2475, #2980).
    Refuse,
}

/// One `[[lerobot.serve]]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LerobotServe {
    /// The client's `pretrained_name_or_path`.
    pub pretrained: String,
    /// The served policy's name.
    pub policy: String,
    /// The client's `policy_type` must equal it, if given.
    pub policy_type: Option<String>,
}

/// `[lerobot]`'s values; `serve` entries must name served policies.
pub(super) fn lerobot(
    l: &RawLerobot,
    policies: &[PolicySpec],
    default: usize,
) -> Result<LerobotConfig, ConfigError> {
    let (listen, allow) = addresses(l)?;
    let long_poll_ms = l.long_poll_ms.unwrap_or(2000);
    if !(1..=60_000).contains(&long_poll_ms) {
        return Err(invalid(
            "lerobot.long_poll_ms",
            format!("must be within 1..=60000 (LeRobot's server waits 2000), got {long_poll_ms}"),
        ));
    }
    let max_payload_bytes = l.max_payload_bytes.unwrap_or(32 << 20);
    if !(1024..=(1 << 30)).contains(&max_payload_bytes) {
        return Err(invalid(
            "lerobot.max_payload_bytes",
            format!(
                "must be within 1024..=1073741824 (three 640x480 cameras pickle to 2.8 MB), got \
                 {max_payload_bytes}"
            ),
        ));
    }
    let cx = Keys::top();
    // "bilinear" is what LeRobot 0.6.1's server does.
    let resize = cx.one_of(
        "lerobot.resize",
        l.resize.as_deref(),
        Some(LerobotResize::Bilinear),
        &[
            ("bilinear", LerobotResize::Bilinear),
            ("refuse", LerobotResize::Refuse),
        ],
    )?;
    let (max_connections, max_connections_per_peer) = connection_caps(&cx, l)?;
    let seconds = |key: &str, v: Option<f64>, default: f64, max: f64| {
        let v = v.unwrap_or(default);
        if v.is_finite() && v > 0.0 && v <= max {
            Ok(std::time::Duration::from_secs_f64(v))
        } else {
            Err(cx.invalid(
                key,
                format!("must be a number of seconds above 0 and at most {max}, got {v}"),
            ))
        }
    };
    let handshake_timeout = seconds(
        "lerobot.handshake_timeout_s",
        l.handshake_timeout_s,
        10.0,
        3600.0,
    )?;
    let idle_timeout = seconds("lerobot.idle_timeout_s", l.idle_timeout_s, 120.0, 86400.0)?;
    let chunk_timeout = seconds("lerobot.chunk_timeout_s", l.chunk_timeout_s, 5.0, 3600.0)?;
    let observation_timeout = seconds(
        "lerobot.observation_timeout_s",
        l.observation_timeout_s,
        10.0,
        3600.0,
    )?;
    let takeover_after = seconds(
        "lerobot.takeover_after_s",
        l.takeover_after_s,
        10.0,
        86400.0,
    )?;
    let owner_grace = seconds("lerobot.owner_grace_s", l.owner_grace_s, 60.0, 86400.0)?;
    let long_poll = std::time::Duration::from_millis(long_poll_ms);
    check_deadlines(
        &cx,
        long_poll,
        idle_timeout,
        chunk_timeout,
        observation_timeout,
    )?;
    let serve = serve_names(l, policies, default)?;
    Ok(LerobotConfig {
        listen,
        allow,
        long_poll,
        max_payload_bytes,
        resize,
        max_connections,
        max_connections_per_peer,
        handshake_timeout,
        idle_timeout,
        chunk_timeout,
        observation_timeout,
        takeover_after,
        owner_grace,
        serve,
    })
}

/// `lerobot.max_connections` and `max_connections_per_peer` (default: half the cap).
fn connection_caps(cx: &Keys, l: &RawLerobot) -> Result<(usize, usize), ConfigError> {
    let max_connections = l.max_connections.unwrap_or(16);
    cx.between("lerobot.max_connections", max_connections, 1, 1024)?;
    let max_connections_per_peer = l
        .max_connections_per_peer
        .unwrap_or(max_connections.div_ceil(2));
    cx.between(
        "lerobot.max_connections_per_peer",
        max_connections_per_peer,
        1,
        max_connections,
    )?;
    Ok((max_connections, max_connections_per_peer))
}

/// `lerobot.listen` and `lerobot.allow`.
fn addresses(l: &RawLerobot) -> Result<(std::net::SocketAddr, Vec<ipnet::IpNet>), ConfigError> {
    let listen = l.listen.as_deref().ok_or_else(|| {
        invalid(
            "lerobot.listen",
            "missing: the service needs its own address, e.g. \"0.0.0.0:8080\" (LeRobot's \
             clients default to port 8080)",
        )
    })?;
    let listen = listen.parse().map_err(|_| {
        invalid(
            "lerobot.listen",
            format!("\"{listen}\" is not an address with a port, e.g. \"0.0.0.0:8080\""),
        )
    })?;
    let allow = l
        .allow
        .iter()
        .map(|a| {
            a.parse::<ipnet::IpNet>()
                .or_else(|_| a.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| {
                    invalid(
                        "lerobot.allow",
                        format!(
                            "\"{a}\" is not an address or a CIDR network such as 192.168.1.0/24"
                        ),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((listen, allow))
}

/// The deadlines against each other: a long poll ends before the idle timeout, a chunk's
/// deadline within an observation's.
fn check_deadlines(
    cx: &Keys,
    long_poll: std::time::Duration,
    idle_timeout: std::time::Duration,
    chunk_timeout: std::time::Duration,
    observation_timeout: std::time::Duration,
) -> Result<(), ConfigError> {
    if idle_timeout <= long_poll {
        return Err(cx.invalid(
            "lerobot.idle_timeout_s",
            format!(
                "must be longer than lerobot.long_poll_ms ({} ms), or a client \
                 waiting for actions is cut off",
                long_poll.as_millis()
            ),
        ));
    }
    if observation_timeout < chunk_timeout {
        return Err(cx.invalid(
            "lerobot.observation_timeout_s",
            "must be at least lerobot.chunk_timeout_s (one chunk is part of an observation)",
        ));
    }
    Ok(())
}

/// `[[lerobot.serve]]`: the names a `robot_client` may ask for, each on a served policy (the
/// default one unless named).
fn serve_names(
    l: &RawLerobot,
    policies: &[PolicySpec],
    default: usize,
) -> Result<Vec<LerobotServe>, ConfigError> {
    let mut serve = Vec::new();
    for (i, s) in l.serve.iter().enumerate() {
        let key = format!("lerobot.serve[{i}]");
        if s.pretrained.trim().is_empty() {
            return Err(invalid(format!("{key}.pretrained"), "must not be empty"));
        }
        let policy = match &s.policy {
            Some(p) if policies.iter().any(|q| &q.name == p) => p.clone(),
            Some(p) => {
                let names: Vec<&str> = policies.iter().map(|q| q.name.as_str()).collect();
                return Err(invalid(
                    format!("{key}.policy"),
                    format!("no policy is named \"{p}\"; served: {}", names.join(", ")),
                ));
            }
            None => policies[default].name.clone(),
        };
        if s.policy_type
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(invalid(format!("{key}.policy_type"), "must not be empty"));
        }
        serve.push(LerobotServe {
            pretrained: s.pretrained.clone(),
            policy,
            policy_type: s.policy_type.clone(),
        });
    }
    Ok(serve)
}
