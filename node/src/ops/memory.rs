//! This process's memory as the kernel counts it: resident set now and its
//! peak (`VmRSS` and `VmHWM` in `/proc/self/status`). Linux only; `None`
//! elsewhere or when the file cannot be read.

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

/// Parse the `VmRSS` and `VmHWM` lines of a `/proc/PID/status` text (the
/// testnet launcher reads other processes' memory with the same parsers).
pub fn parse(status: &str) -> Option<Memory> {
    Some(Memory {
        rss_bytes: shoal_testnet::report::vm_rss_bytes(status)?,
        peak_rss_bytes: shoal_testnet::report::vm_hwm_bytes(status)?,
    })
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
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_memory_and_its_peak_is_not_below_it() {
        let m = current().expect("/proc/self/status");
        assert!(m.rss_bytes > 1 << 20, "{m:?}");
        assert!(m.peak_rss_bytes >= m.rss_bytes, "{m:?}");
    }
}
