//! glibc's allocator, tuned for a trainer's large short-lived buffers.
//!
//! By default glibc hands every block above its mmap threshold (128 KiB,
//! rising to at most 32 MiB as such blocks are freed) to the kernel with
//! `mmap` and gives it back with `munmap` when it is freed, and it returns
//! the free top of each heap once that exceeds its trim threshold. A
//! training step allocates tens of MiB of tensors (the CNN's unfolded
//! input is 20 MiB at batch 64, a 25M-parameter model's gradient 100 MiB)
//! and frees them at its end, so every step faulted all of those pages in
//! afresh, zeroed by the kernel: `shoal train --model cnn` spent more time
//! in the kernel than in user code (6.3M minor faults in 150 steps), and
//! the 4-node demo 4 s of its 15 s of CPU.
//!
//! glibc reads its tunables only when a process starts, and setting them
//! from inside (`mallopt`) would need unsafe code, which this workspace
//! forbids. So `shoal` re-executes itself once at start with
//! `GLIBC_TUNABLES` set to [`tunables`] (the same binary, arguments and
//! process id; `exec` replaces the image). The block sizes are the peak
//! of the largest step, so a node's peak memory is unchanged; what
//! changes is that up to [`TRIM_THRESHOLD`] of freed memory stays mapped
//! for the next step instead of going back to the kernel.
//!
//! A `GLIBC_TUNABLES` already in the environment is left as it is: set it
//! (empty for glibc's defaults) to choose otherwise. Other C libraries
//! (musl) and other systems run without re-executing.

/// Blocks up to this size come from the heap, not from `mmap` (256 MiB).
pub const MMAP_THRESHOLD: u64 = 256 << 20;

/// Free memory at the top of a heap is given back to the kernel only past
/// this much (512 MiB).
pub const TRIM_THRESHOLD: u64 = 512 << 20;

/// The `GLIBC_TUNABLES` value `shoal` starts under.
pub fn tunables() -> String {
    format!("glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}")
}

/// The variable that, when present, leaves the allocator as it is.
pub const TUNABLES_VAR: &str = "GLIBC_TUNABLES";

/// Whether this build links glibc (the only C library re-executed for).
const GNU_LIBC: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// Whether to re-execute with [`tunables`]: on glibc only, and only when
/// the environment does not set `GLIBC_TUNABLES` already (which also ends
/// the re-execution after one round). Pure, for the tests.
pub fn should_reexec(gnu_libc: bool, tunables_set: bool) -> bool {
    gnu_libc && !tunables_set
}

/// Re-executes this binary with [`tunables`] when [`should_reexec`] says
/// so. Returns only when it does not re-execute or `exec` failed (the node
/// then runs on glibc's defaults; the reason is given back for a log line).
pub fn reexec_tuned() -> Option<String> {
    if !should_reexec(GNU_LIBC, std::env::var_os(TUNABLES_VAR).is_some()) {
        return None;
    }
    exec_with_tunables()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exec_with_tunables() -> Option<String> {
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Some(format!("cannot find this binary to re-execute it: {e}")),
    };
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(&exe);
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    let err = cmd.args(args).env(TUNABLES_VAR, tunables()).exec();
    Some(format!("cannot re-execute {} with {TUNABLES_VAR}: {err}", exe.display()))
}

/// Never called: [`should_reexec`] is false without glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exec_with_tunables() -> Option<String> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_glibc_without_tunables_of_its_own_re_executes() {
        assert!(should_reexec(true, false));
        assert!(!should_reexec(true, true), "a user's GLIBC_TUNABLES (or the re-executed process) is left alone");
        assert!(!should_reexec(false, false), "musl and other systems keep their allocator");
    }

    #[test]
    fn the_tunables_name_both_thresholds_in_glibc_syntax() {
        assert_eq!(tunables(), "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=536870912");
    }
}
