//! Files written so that a crash never leaves a mix of old and new.

use std::path::Path;

use crate::error::{ModelError, Result};

/// Write `bytes` to `path` so that a crash at any point leaves either the old
/// file or the new one under that name, never a mix (see [`write_atomic_with`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| std::fs::write(tmp, bytes).map_err(|e| ModelError::io(tmp, e)))
}

/// Write a file through `write`, which fills the temporary file it is
/// given, so that a crash at any point leaves either the old file or the new
/// one under `path`: the temporary file (in the same folder,
/// `<name>.<pid>-<n>.tmp`) is
/// fsynced, renamed over `path`, and the folder is fsynced (so the rename
/// itself survives a power cut). Folders are created.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    // Unique per write, so that two writers of one folder never share a
    // temporary file.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".{}-{n}.tmp", std::process::id()));
    let tmp = dir.join(name);
    let written = write(&tmp)
        .and_then(|()| std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| ModelError::io(&tmp, e)));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))?;
    // Persist the directory entry; not every platform can open a folder.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
