//! `shoal data fetch`: make Fashion-MNIST available from Debian's package.
//!
//! Two ways, as `scripts/fetch-data.sh` does them: `apt-get install` when we
//! are root, or `apt-get download` + `dpkg-deb -x` into `--dest` without root.
//! Either way the decompressed sizes are verified afterwards.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use flate2::read::GzDecoder;
use shoal_models::data::{fashion_mnist_dir, FASHION_MNIST_FILES, SYSTEM_FASHION_MNIST_DIR};
use tracing::info;

use crate::cmd::cli::{FetchArgs, FetchMethod, FetchableDataset};

const PACKAGE: &str = "dataset-fashion-mnist";

#[allow(clippy::print_stdout)] // The CLI's own output.
pub fn fetch(args: FetchArgs) -> anyhow::Result<()> {
    let FetchableDataset::FashionMnist = args.dataset;
    if let Some(dir) = fashion_mnist_dir(Some(&args.dest)).or_else(|| fashion_mnist_dir(None)) {
        verify(&dir)?;
        println!("fashion-mnist already present and verified in {}", dir.display());
        return Ok(());
    }
    let method = match args.method {
        FetchMethod::Auto if is_root() => FetchMethod::AptInstall,
        FetchMethod::Auto => FetchMethod::Download,
        m => m,
    };
    let dir = match method {
        FetchMethod::AptInstall => {
            run(Command::new("apt-get").args(["install", "-y", PACKAGE]))
                .or_else(|_| {
                    // The package lists may be stale or empty on a fresh machine.
                    run(Command::new("apt-get").arg("update"))?;
                    run(Command::new("apt-get").args(["install", "-y", PACKAGE]))
                })
                .context("apt-get install failed (are you root? try --method download)")?;
            PathBuf::from(SYSTEM_FASHION_MNIST_DIR)
        }
        FetchMethod::Download | FetchMethod::Auto => download(&args.dest)?,
    };
    verify(&dir)?;
    println!("fashion-mnist ready and verified in {}", dir.display());
    Ok(())
}

fn download(dest: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    let work = dest.join(".download");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    run(Command::new("apt-get").arg("download").arg(PACKAGE).current_dir(&work))
        .context("apt-get download failed (is a Debian mirror reachable?)")?;
    let deb = std::fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", work.display()))?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(dest)).context("dpkg-deb -x failed")?;
    std::fs::remove_dir_all(&work).ok();
    fashion_mnist_dir(Some(dest)).with_context(|| format!("{} did not contain the expected files", deb.display()))
}

/// Check that every file decompresses to exactly the expected size.
pub fn verify(dir: &Path) -> anyhow::Result<()> {
    for (name, expected) in FASHION_MNIST_FILES {
        let path = dir.join(name);
        let file = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let mut n = 0u64;
        let mut buf = vec![0u8; 1 << 16];
        let mut gz = GzDecoder::new(file);
        loop {
            let k = gz.read(&mut buf).with_context(|| format!("decompressing {}", path.display()))?;
            if k == 0 {
                break;
            }
            n += k as u64;
        }
        if n != expected {
            bail!("{} decompresses to {n} bytes, expected {expected}", path.display());
        }
        info!(file = %path.display(), bytes = n, "verified");
    }
    Ok(())
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    info!(command = ?cmd, "running");
    let status = cmd.status().with_context(|| format!("cannot start {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{:?} exited with {status}", cmd.get_program());
    }
    Ok(())
}

fn is_root() -> bool {
    // /proc/self/status has "Uid: real effective saved fs"; no libc needed.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
