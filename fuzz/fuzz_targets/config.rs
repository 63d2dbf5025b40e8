//! The config parser and each policy's plan.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| policyd::testing::fuzz::config(data));
