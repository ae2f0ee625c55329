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
//! forbids. A `#[global_allocator]` (jemalloc, mimalloc) was measured
//! instead and was slower on this workload (docs/benchmarks.md, "Tried and
//! not kept"). So `shoal` re-executes itself once at start with
//! `GLIBC_TUNABLES` set to [`tunables`] (the same binary, arguments and
//! process id; `execve` replaces the image; a binary the kernel cannot
//! execute directly, as under qemu-user, runs on glibc's defaults). The
//! block sizes are the peak of the largest step, so a node's peak memory
//! is unchanged; what changes is that up to [`TRIM_THRESHOLD`] of freed
//! memory stays mapped for the next step instead of going back to the
//! kernel.
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

/// `execve` itself, not `std::process::Command::exec`: std's exec goes
/// through glibc's `execvp`, which on `ENOEXEC` hands the file to `/bin/sh`
/// as a script. Under qemu-user without binfmt (the way CI runs the
/// aarch64 build) the kernel cannot execute the ELF file, and a shell then
/// read it and failed with a syntax error instead of the node starting. A
/// plain `execve` fails with `ENOEXEC`, and the node runs on glibc's
/// defaults.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exec_with_tunables() -> Option<String> {
    match std::env::current_exe() {
        Ok(exe) => Some(exec_tuned(&exe)),
        Err(e) => Some(format!("cannot find this binary to re-execute it: {e}")),
    }
}

/// Replace this process with `exe`, run with this process's arguments and
/// environment and `GLIBC_TUNABLES` set to [`tunables`]. Returns only on
/// failure, with the reason.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exec_tuned(exe: &std::path::Path) -> String {
    use std::ffi::{CString, OsStr};
    use std::os::unix::ffi::OsStrExt;
    let c_string = |s: &OsStr| CString::new(s.as_bytes()).ok();
    let Some(path) = c_string(exe.as_os_str()) else {
        return format!("cannot re-execute {}: a NUL in its path", exe.display());
    };
    // Arguments and variables came from the kernel as C strings: none holds a NUL.
    let args: Vec<CString> = std::env::args_os().filter_map(|a| c_string(&a)).collect();
    let mut env: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| k != TUNABLES_VAR)
        .filter_map(|(k, v)| CString::new([k.as_bytes(), b"=", v.as_bytes()].concat()).ok())
        .collect();
    env.extend(CString::new(format!("{TUNABLES_VAR}={}", tunables())).ok());
    match nix::unistd::execve(&path, &args, &env) {
        Ok(never) => match never {},
        Err(nix::errno::Errno::ENOEXEC) => format!(
            "cannot re-execute {} with {TUNABLES_VAR}: the kernel cannot run it directly (an emulator such as \
             qemu-user without binfmt?)",
            exe.display()
        ),
        Err(e) => format!("cannot re-execute {} with {TUNABLES_VAR}: {e}", exe.display()),
    }
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
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn a_file_the_kernel_cannot_execute_is_not_handed_to_a_shell() -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        // An executable file that is neither an ELF binary nor a `#!`
        // script, as an aarch64 binary is to an x86-64 kernel without
        // binfmt. glibc's execvp (std's exec) would run it with /bin/sh and
        // replace this test process; execve fails with ENOEXEC and returns.
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("not-a-binary");
        std::fs::write(&file, "echo this must not run as a script\n")?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o755))?;
        let why = exec_tuned(&file);
        assert!(why.contains("the kernel cannot run it directly"), "{why}");
        assert!(why.contains(&file.display().to_string()), "{why}");
        // A binary that is not there fails with the system's reason.
        let gone = exec_tuned(&dir.path().join("missing"));
        assert!(gone.contains("ENOENT"), "{gone}");
        Ok(())
    }

    #[test]
    fn the_tunables_name_both_thresholds_in_glibc_syntax() {
        assert_eq!(tunables(), "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=536870912");
    }
}
