//! How does a log line that any peer can provoke stay out of a flood? Each such line (a refused
//! peer, a refused API key, a failed accept) goes through [`log_limited!`](crate::log_limited): the first is logged,
//! later ones within a second are only counted, and the next line logged after that says how
//! many were left out. One limiter per call site, so one reason cannot hide another. The
//! metrics still count every event; this is only about the journal (66,062 lines in 10 s from
//! one client before).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// At most one line per this many milliseconds per call site.
pub const INTERVAL_MS: u64 = 1000;

const NEVER: u64 = u64::MAX;

/// One call site's limiter: when it last logged, and how many it has left out since.
pub struct LogLimit {
    last_ms: AtomicU64,
    left_out: AtomicU64,
}

impl Default for LogLimit {
    fn default() -> Self {
        Self::new()
    }
}

impl LogLimit {
    pub const fn new() -> LogLimit {
        LogLimit {
            last_ms: AtomicU64::new(NEVER),
            left_out: AtomicU64::new(0),
        }
    }

    /// Whether to log now; if so, how many lines were left out since the last one.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(now_ms())
    }

    /// [`admit`](Self::admit) at a given time (milliseconds on a monotonic clock).
    pub fn admit_at(&self, now: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == NEVER || now.saturating_sub(last) >= INTERVAL_MS;
        if due
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.left_out.swap(0, Ordering::Relaxed));
        }
        self.left_out.fetch_add(1, Ordering::Relaxed);
        None
    }
}

fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// `log::log!` at `level` at most once a second for this call site, saying how many lines like
/// it were left out since the last.
#[macro_export]
macro_rules! log_limited {
    ($level:expr, $($arg:tt)+) => {{
        static LIMIT: $crate::log_limit::LogLimit = $crate::log_limit::LogLimit::new();
        if let Some(n) = LIMIT.admit() {
            if n > 0 {
                log::log!($level, "{} ({n} more like it not logged)", format_args!($($arg)+));
            } else {
                log::log!($level, $($arg)+);
            }
        }
    }};
}

/// Any text shown with its control characters escaped (`\n`, `\u{1b}`): what the logger does
/// to every line, so that no string a client sent can end a log line and start one of its own
/// (journald reads a line that starts `<0>` as an emergency).
pub struct Escaped<T>(pub T);

impl<T: std::fmt::Display> std::fmt::Display for Escaped<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        struct Escaping<'a, 'b>(&'a mut std::fmt::Formatter<'b>);
        impl std::fmt::Write for Escaping<'_, '_> {
            fn write_str(&mut self, s: &str) -> std::fmt::Result {
                for part in s.split_inclusive(char::is_control) {
                    let mut chars = part.chars();
                    match chars.next_back() {
                        Some(c) if c.is_control() => {
                            self.0.write_str(chars.as_str())?;
                            write!(self.0, "{}", c.escape_default())?;
                        }
                        _ => self.0.write_str(part)?,
                    }
                }
                Ok(())
            }
        }
        use std::fmt::Write;
        write!(Escaping(f), "{}", self.0)
    }
}

/// [`log_limited!`](crate::log_limited) at warning level.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {
        $crate::log_limited!(log::Level::Warn, $($arg)+)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_escaped() {
        let forged = "x\n<0>policyd::app: INJECTED\r\u{1b}[31m é";
        let shown = Escaped(forged).to_string();
        assert_eq!(shown, "x\\n<0>policyd::app: INJECTED\\r\\u{1b}[31m é");
        assert!(!shown.chars().any(char::is_control));
        assert_eq!(Escaped(format_args!("a{}b", '\n')).to_string(), "a\\nb");
    }

    #[test]
    fn one_line_a_second_then_the_count_left_out() {
        let l = LogLimit::new();
        assert_eq!(l.admit_at(5), Some(0), "the first line is logged");
        for t in 6..1005 {
            assert_eq!(
                l.admit_at(t),
                None,
                "within the second: counted, not logged"
            );
        }
        assert_eq!(l.admit_at(1005), Some(999), "then one line with the count");
        assert_eq!(l.admit_at(1006), None);
        assert_eq!(l.admit_at(3000), Some(1));
    }
}
