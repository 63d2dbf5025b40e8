//! The wire decoder, both dialects' replies, against several binding sets.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| policyd::testing::fuzz::decode(data));
