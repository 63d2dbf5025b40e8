//! History: how many frames of a numeric input the engine takes (LeRobot's `n_obs_steps`),
//! the request sending one and the session keeping the ones before it.

use super::key;
use super::raw::{RawInput, is_text};
use crate::config::{ConfigError, Keys};

pub(super) fn resolve(cx: &Keys, i: usize, b: &RawInput) -> Result<usize, ConfigError> {
    let k = |f: &str| key(i, f);
    let history = b.history.unwrap_or(1);
    if !(1..=crate::limits::MAX_HISTORY).contains(&history) {
        return Err(cx.invalid(
            k("history"),
            format!(
                "must be 1 to {} frames, got {history}",
                crate::limits::MAX_HISTORY
            ),
        ));
    }
    if history > 1 && is_text(b) {
        return Err(cx.invalid(k("history"), "applies to numeric inputs, not text"));
    }
    Ok(history)
}
