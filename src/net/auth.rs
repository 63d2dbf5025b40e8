//! Who may connect? API keys, checked in the HTTP handshake before any WebSocket frame is
//! exchanged.
//!
//! openpi-client sends `Authorization: Api-Key <key>` (`WebsocketClientPolicy(api_key=…)`);
//! `Bearer <key>` is accepted too, for other clients. Every configured key is compared in
//! constant time (no early exit on the first differing byte, and every key is tried), and a
//! key never appears in a log line, an error message or a `Debug` print.

use std::path::Path;

use subtle::ConstantTimeEq;

use crate::config::{ConfigError, invalid};

/// Shortest key accepted: shorter ones are guessable.
pub const MIN_KEY_LEN: usize = 16;
const MAX_KEY_LEN: usize = 512;

/// The keys that open a WebSocket (and `/metrics`, if protected). Empty: no check.
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys, redacted)", self.keys.len())
    }
}

/// What a request's `Authorization` header amounted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    Missing,
    Wrong,
    /// More than one `Authorization` header: refused whatever they hold, so that a proxy
    /// that appends its own cannot disagree with policyd about which one counts.
    Ambiguous,
}

impl Verdict {
    pub fn describe(self) -> &'static str {
        match self {
            Verdict::Accepted => "accepted",
            Verdict::Missing => "no API key (Authorization: Api-Key <key>)",
            Verdict::Wrong => "wrong API key",
            Verdict::Ambiguous => "more than one Authorization header; send exactly one",
        }
    }
}

fn check_key(key: &str, name: &str) -> Result<Vec<u8>, ConfigError> {
    if key.len() < MIN_KEY_LEN || key.len() > MAX_KEY_LEN {
        return Err(invalid(
            name,
            format!(
                "an API key must be {MIN_KEY_LEN} to {MAX_KEY_LEN} characters long \
                 (e.g. `openssl rand -hex 32`)"
            ),
        ));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            name,
            "an API key may hold only printable ASCII without spaces (it travels in an HTTP header)",
        ));
    }
    Ok(key.as_bytes().to_vec())
}

impl ApiKeys {
    /// `inline` (`auth.api_keys`) plus the lines of `file` (`auth.key_file`: one key a line,
    /// blank lines and `#` comments skipped), checked.
    pub fn load(inline: &[String], file: Option<&Path>) -> Result<ApiKeys, ConfigError> {
        let mut keys = Vec::new();
        for (i, k) in inline.iter().enumerate() {
            keys.push(check_key(k, &format!("auth.api_keys[{i}]"))?);
        }
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                invalid(
                    "auth.key_file",
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                keys.push(check_key(
                    line,
                    &format!("auth.key_file ({} line {})", path.display(), n + 1),
                )?);
            }
            if keys.is_empty() {
                return Err(invalid(
                    "auth.key_file",
                    format!("{} holds no key", path.display()),
                ));
            }
        }
        Ok(ApiKeys { keys })
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Checks every `Authorization` header a request carried: more than one is refused
    /// ([`Verdict::Ambiguous`]) whatever they hold.
    pub fn check_all(&self, headers: &[String]) -> Verdict {
        match headers {
            [] => self.check(None),
            [one] => self.check(Some(one)),
            _ => Verdict::Ambiguous,
        }
    }

    /// Checks an `Authorization` header value.
    pub fn check(&self, header: Option<&str>) -> Verdict {
        let Some(value) = header else {
            return Verdict::Missing;
        };
        let given = value
            .strip_prefix("Api-Key ")
            .or_else(|| value.strip_prefix("Bearer "))
            .unwrap_or("")
            .trim()
            .as_bytes();
        if given.is_empty() {
            return Verdict::Missing;
        }
        let mut ok = subtle::Choice::from(0);
        for k in &self.keys {
            ok |= k.as_slice().ct_eq(given);
        }
        if bool::from(ok) {
            Verdict::Accepted
        } else {
            Verdict::Wrong
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "0123456789abcdef0123";
    const K2: &str = "fedcba9876543210fedc";

    #[test]
    fn accepts_any_configured_key_in_either_scheme() {
        let keys = ApiKeys::load(&[K1.into(), K2.into()], None).unwrap();
        assert!(keys.enabled());
        assert_eq!(
            keys.check(Some(&format!("Api-Key {K1}"))),
            Verdict::Accepted
        );
        assert_eq!(keys.check(Some(&format!("Bearer {K2}"))), Verdict::Accepted);
        assert_eq!(keys.check(Some(&format!("Api-Key {K1}x"))), Verdict::Wrong);
        assert_eq!(keys.check(Some("Api-Key 0123")), Verdict::Wrong);
        assert_eq!(keys.check(Some(K1)), Verdict::Missing, "no scheme");
        assert_eq!(keys.check(Some("Api-Key ")), Verdict::Missing);
        assert_eq!(keys.check(None), Verdict::Missing);
        assert!(!format!("{keys:?}").contains(K1), "Debug never shows a key");
    }

    #[test]
    fn key_file_and_bad_keys_name_where_without_showing_the_key() {
        let dir = std::env::temp_dir().join(format!("policyd-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys");
        std::fs::write(&f, format!("# robots\n\n{K2}\n")).unwrap();
        let keys = ApiKeys::load(&[], Some(&f)).unwrap();
        assert_eq!(
            keys.check(Some(&format!("Api-Key {K2}"))),
            Verdict::Accepted
        );

        std::fs::write(&f, "# nothing\n").unwrap();
        let e = ApiKeys::load(&[], Some(&f)).unwrap_err().to_string();
        assert!(e.contains("auth.key_file") && e.contains("no key"), "{e}");
        std::fs::write(&f, "short-secret\n").unwrap();
        let e = ApiKeys::load(&[], Some(&f)).unwrap_err().to_string();
        assert!(e.contains("line 1") && !e.contains("short-secret"), "{e}");
        let e = ApiKeys::load(&["has a space in it!!".into()], None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("auth.api_keys[0]") && !e.contains("space in"),
            "{e}"
        );
        let e = ApiKeys::load(&[], Some(&dir.join("missing")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
