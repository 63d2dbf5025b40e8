//! Where does the planner send its calls? The planner's endpoints: OpenAI-compatible servers used
//! round-robin, each probed for readiness (`GET /v1/models`) with backoff, a failing one skipped
//! until it answers again.

use std::time::{Duration, Instant};

/// First wait before probing an endpoint that failed; doubles up to `max_backoff_s`.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Largest answer read from a server (a chat completion of a few hundred tokens is a few KiB).
const MAX_BODY: u64 = 1 << 20;
/// Longest a readiness probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a call got no usable message.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("no endpoint is ready (each failed its last call or probe)")]
    NoEndpoint,
    #[error("{endpoint}: no answer within {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
    #[error("{endpoint}: {message}")]
    Transport { endpoint: String, message: String },
    #[error("{endpoint}: HTTP {status}: {body}")]
    Status {
        endpoint: String,
        status: u16,
        body: String,
    },
    #[error("{endpoint}: not a chat completion: {message}")]
    BadResponse { endpoint: String, message: String },
}

struct Endpoint {
    base: String,
    ready: bool,
    retry_at: Instant,
    backoff: Duration,
}

impl Endpoint {
    fn failed(&mut self, max: Duration) {
        self.ready = false;
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(max);
    }

    fn answered(&mut self) {
        self.ready = true;
        self.backoff = FIRST_BACKOFF;
    }
}

/// The endpoint set and the HTTP agent.
pub struct Endpoints {
    list: Vec<Endpoint>,
    next: usize,
    agent: ureq::Agent,
    probe: ureq::Agent,
    auth: Option<String>,
    timeout: Duration,
    max_backoff: Duration,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

impl Endpoints {
    pub fn new(
        bases: &[String],
        api_key: Option<&str>,
        timeout: Duration,
        max_backoff: Duration,
    ) -> Self {
        let now = Instant::now();
        Endpoints {
            list: bases
                .iter()
                .map(|b| Endpoint {
                    base: b.trim_end_matches('/').to_string(),
                    // Unknown until probed.
                    ready: false,
                    retry_at: now,
                    backoff: FIRST_BACKOFF,
                })
                .collect(),
            next: 0,
            agent: agent(timeout),
            probe: agent(PROBE_TIMEOUT.min(timeout)),
            auth: api_key.map(|k| format!("Bearer {k}")),
            timeout,
            max_backoff,
        }
    }

    /// Endpoints that answered their last call or probe.
    pub fn ready(&self) -> usize {
        self.list.iter().filter(|e| e.ready).count()
    }

    /// Probes endpoint `i` (`GET /v1/models`): any 2xx answer makes it ready.
    pub fn probe(&mut self, i: usize) -> bool {
        let url = format!("{}/v1/models", self.list[i].base);
        let mut req = self.probe.get(&url);
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        let ok = req.call().is_ok_and(|r| r.status().is_success());
        if ok {
            if !self.list[i].ready {
                log::info!("planner: endpoint {} is ready", self.list[i].base);
            }
            self.list[i].answered();
        } else {
            self.list[i].failed(self.max_backoff);
        }
        ok
    }

    /// Probes every endpoint once; true when one is ready.
    pub fn probe_all(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.list.len() {
            any |= self.probe(i);
        }
        any
    }

    /// The next usable endpoint in round-robin order: a ready one, or one whose backoff has
    /// passed and that answers its probe now.
    fn pick(&mut self) -> Option<usize> {
        let n = self.list.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            let e = &self.list[i];
            if e.ready || (Instant::now() >= e.retry_at && self.probe(i)) {
                self.next = (i + 1) % n;
                return Some(i);
            }
        }
        None
    }

    /// POSTs a chat-completions request and returns the first choice's message content. An
    /// endpoint that fails (no connection, timeout, 5xx, 429) is marked down and the next one
    /// is tried; a 4xx (the request's fault) is returned as is.
    pub fn chat(&mut self, body: &serde_json::Value) -> Result<String, CallError> {
        let body = body.to_string();
        let mut last = CallError::NoEndpoint;
        for _ in 0..self.list.len() {
            let Some(i) = self.pick() else { break };
            match self.post(i, &body) {
                Ok(content) => {
                    self.list[i].answered();
                    return Ok(content);
                }
                Err(e) => {
                    let down = match &e {
                        CallError::Status { status, .. } => *status >= 500 || *status == 429,
                        CallError::BadResponse { .. } => false,
                        _ => true,
                    };
                    if !down {
                        return Err(e);
                    }
                    log::warn!("planner: {e}; skipping the endpoint until it answers again");
                    self.list[i].failed(self.max_backoff);
                    last = e;
                }
            }
        }
        Err(last)
    }

    fn post(&self, i: usize, body: &str) -> Result<String, CallError> {
        let endpoint = self.list[i].base.clone();
        let url = format!("{endpoint}/v1/chat/completions");
        let mut req = self.agent.post(&url).content_type("application/json");
        if let Some(a) = &self.auth {
            req = req.header("Authorization", a);
        }
        let transport = |e: ureq::Error, endpoint: String| match e {
            ureq::Error::Timeout(_) => CallError::Timeout {
                endpoint,
                timeout: self.timeout,
            },
            other => CallError::Transport {
                endpoint,
                message: other.to_string(),
            },
        };
        let mut resp = match req.send(body) {
            Ok(r) => r,
            Err(e) => return Err(transport(e, endpoint)),
        };
        let status = resp.status().as_u16();
        let text = match resp
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_string()
        {
            Ok(t) => t,
            Err(e) => return Err(transport(e, endpoint)),
        };
        if !(200..300).contains(&status) {
            return Err(CallError::Status {
                endpoint,
                status,
                body: text.chars().take(200).collect(),
            });
        }
        message_content(&text).map_err(|message| CallError::BadResponse { endpoint, message })
    }
}

/// `choices[0].message.content` of a chat completion.
fn message_content(text: &str) -> Result<String, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON ({e})"))?;
    match v.pointer("/choices/0/message/content") {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        _ => Err("no choices[0].message.content string".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_content_is_read_from_the_first_choice() {
        let ok = r#"{"choices":[{"message":{"role":"assistant","content":"hi"}}]}"#;
        assert_eq!(message_content(ok).as_deref(), Ok("hi"));
        assert!(message_content("{}").is_err());
        assert!(message_content("not json").is_err());
    }
}
