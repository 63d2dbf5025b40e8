# Sourced by the cross scripts: cargo settings for aarch64-unknown-linux-gnu with Debian's
# cross toolchain (gcc- and g++-aarch64-linux-gnu, libc6-dev-arm64-cross) and qemu-user as the runner
# (also for tests that start the binary themselves).
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
export POLICYD_CROSS_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
