//! This process's memory as the kernel counts it: resident set now and its
//! peak (`VmRSS` and `VmHWM` in `/proc/self/status`), and the memory the
//! machine has left for it. Linux only; `None` elsewhere or when the files
//! cannot be read.

/// Resident bytes now and the most there have been, in this process's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
}

/// Read this process's memory.
pub fn current() -> Option<Memory> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse(&status)
}

/// Parse the `VmRSS` and `VmHWM` lines of a `/proc/PID/status` text.
pub fn parse(status: &str) -> Option<Memory> {
    Some(Memory { rss_bytes: kib_line(status, "VmRSS:")?, peak_rss_bytes: kib_line(status, "VmHWM:")? })
}

/// The value of the line `key` of a `/proc` text that counts in kB
/// (`/proc/PID/status`, `/proc/meminfo`), in bytes; `None` for a missing
/// line or another unit.
fn kib_line(text: &str, key: &str) -> Option<u64> {
    let rest = text.lines().find_map(|l| l.strip_prefix(key))?;
    match rest.split_whitespace().collect::<Vec<_>>()[..] {
        [n, "kB"] => n.parse::<u64>().ok()?.checked_mul(1024),
        _ => None,
    }
}

/// Memory left for this process: the kernel's `MemAvailable`, capped by
/// the headroom of its cgroup (v2: `memory.max` less `memory.current`)
/// where a limit is set, as in a container.
pub fn available_bytes() -> Option<u64> {
    let machine = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| kib_line(&t, "MemAvailable:"));
    match (machine, cgroup_headroom()) {
        (Some(m), Some(c)) => Some(m.min(c)),
        (m, c) => m.or(c),
    }
}

/// `memory.max` less `memory.current` of this process's cgroup (v2), or
/// `None` without a limit (`max`) or a cgroup v2 to read.
fn cgroup_headroom() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim().trim_start_matches('/');
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok()?.trim().parse::<u64>().ok();
    Some(read("memory.max")?.saturating_sub(read("memory.current")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rss_and_its_peak_in_bytes() {
        let text = "Name:\tshoal\nVmPeak:\t  900000 kB\nVmHWM:\t   61440 kB\nVmRSS:\t   40960 kB\nThreads:\t9\n";
        assert_eq!(parse(text), Some(Memory { rss_bytes: 40960 * 1024, peak_rss_bytes: 61440 * 1024 }));
        assert_eq!(parse("VmRSS:\t12 MB\nVmHWM:\t1 kB\n"), None, "only kB is understood");
        assert_eq!(parse("VmRSS:\t12 kB\n"), None, "no peak line");
        assert_eq!(kib_line("MemAvailable:   2048 kB\n", "MemAvailable:"), Some(2 << 20));
        assert_eq!(kib_line("MemAvailable: x kB\n", "MemAvailable:"), None, "not a number");
        assert_eq!(kib_line(&format!("MemTotal: {} kB\n", u64::MAX), "MemTotal:"), None, "overflow");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_memory_and_its_peak_is_not_below_it() {
        let m = current().expect("/proc/self/status");
        assert!(m.rss_bytes > 1 << 20, "{m:?}");
        assert!(m.peak_rss_bytes >= m.rss_bytes, "{m:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_machine_has_memory_left_within_its_total() {
        let left = available_bytes().expect("/proc/meminfo");
        let text = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
        let total = kib_line(&text, "MemTotal:").expect("MemTotal");
        assert!(left > 1 << 20 && left <= total, "{left} of {total}");
    }
}
