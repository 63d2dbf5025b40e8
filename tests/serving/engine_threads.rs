//! `engine.threads`: the CPU engine's matrix products on a pool gives the same actions as on
//! the engine's own thread, and the key is checked against the machine.

use policyd::config::Config;
use policyd::demo;

use crate::common;

fn run(threads: usize) -> Vec<Vec<u8>> {
    let cfg = demo::config().unwrap();
    let mut spec = cfg.default_policy().clone();
    spec.engine.threads = threads;
    common::patterned_run(&spec).1
}

#[test]
fn two_threads_give_the_actions_one_thread_gives() {
    let one = run(1);
    let two = run(2);
    assert!(
        one.iter().any(|o| o.iter().any(|&b| b != 0)),
        "the model ran"
    );
    assert_eq!(one, two);
}

#[test]
fn threads_are_checked_against_the_machine() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for bad in [0, cpus + 1] {
        let text = format!(
            "[engine]\nmodel = \"m.onnx\"\nthreads = {bad}\n[[inputs]]\nkey = \"s\"\ntensor = \"s\"\n\
             dtypes = [\"float32\"]\nshape = [2]\n[[outputs]]\ntensor = \"a\"\n"
        );
        let e = Config::parse(&text, "t.toml", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("engine.threads"), "{e}");
        assert!(e.contains(&format!("1..={cpus}")), "{e}");
    }
}
