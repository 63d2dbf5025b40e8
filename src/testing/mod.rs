//! What do the tests and fuzzers drive policyd with? A synthetic engine with scripted
//! behaviour ([`synthetic`]) and the fuzz targets' entry points ([`fuzz`]). Compiled only with
//! the `testing` feature, so a serving build carries neither.

pub mod fuzz;
pub mod synthetic;
