//! Fashion-MNIST (Zalando, MIT licence) read from IDX files, as installed by
//! Debian's `dataset-fashion-mnist` or unpacked by `shoal data fetch`.

use std::path::{Path, PathBuf};

use super::idx::read_idx_file;
use super::{Dataset, ImageShape, Split};
use crate::error::{ModelError, Result};

/// Where Debian's package puts the files.
pub const SYSTEM_FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The four files with the exact decompressed sizes they must have.
pub const FASHION_MNIST_FILES: [(&str, u64); 4] = [
    ("train-images-idx3-ubyte.gz", 47_040_016),
    ("train-labels-idx1-ubyte.gz", 60_008),
    ("t10k-images-idx3-ubyte.gz", 7_840_016),
    ("t10k-labels-idx1-ubyte.gz", 10_008),
];

/// The directory that holds Fashion-MNIST: `data_dir` (or its
/// `usr/share/datasets/fashion-mnist` subfolder, as `dpkg-deb -x` lays it out)
/// if given, else `./data/...`, else the system path.
pub fn fashion_mnist_dir(data_dir: Option<&Path>) -> Option<PathBuf> {
    let has_files = |d: &Path| FASHION_MNIST_FILES.iter().all(|(f, _)| d.join(f).is_file());
    let mut candidates = Vec::new();
    match data_dir {
        Some(d) => {
            candidates.push(d.to_path_buf());
            candidates.push(d.join("usr/share/datasets/fashion-mnist"));
            candidates.push(d.join("fashion-mnist"));
        }
        None => {
            candidates.push(PathBuf::from("data/usr/share/datasets/fashion-mnist"));
            candidates.push(PathBuf::from(SYSTEM_FASHION_MNIST_DIR));
        }
    }
    candidates.into_iter().find(|d| has_files(d))
}

/// Load Fashion-MNIST: 60,000 training and 10,000 test images of 28x28.
pub fn load_fashion_mnist(data_dir: Option<&Path>) -> Result<Split> {
    let dir = fashion_mnist_dir(data_dir).ok_or_else(|| ModelError::DatasetMissing {
        name: "fashion-mnist".into(),
        hint: format!(
            "looked in {}; run `shoal data fetch fashion-mnist` or `scripts/fetch-data.sh`, \
             or pass --data-dir",
            match data_dir {
                Some(d) => d.display().to_string(),
                None => format!("./data and {SYSTEM_FASHION_MNIST_DIR}"),
            }
        ),
    })?;
    let train = load_pair(&dir, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")?;
    let test = load_pair(&dir, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")?;
    Ok(Split { train, test })
}

/// Load one images/labels pair and check that they agree.
pub fn load_pair(dir: &Path, images: &str, labels: &str) -> Result<Dataset> {
    let ipath = dir.join(images);
    let lpath = dir.join(labels);
    let imgs = read_idx_file(&ipath)?;
    let labs = read_idx_file(&lpath)?;
    if imgs.dims.len() != 3 {
        return Err(ModelError::bad_file(&ipath, format!("expected 3 dims, got {:?}", imgs.dims)));
    }
    if labs.dims.len() != 1 {
        return Err(ModelError::bad_file(&lpath, format!("expected 1 dim, got {:?}", labs.dims)));
    }
    if imgs.dims[0] != labs.dims[0] {
        return Err(ModelError::bad_file(
            &lpath,
            format!("{} labels for {} images in {}", labs.dims[0], imgs.dims[0], ipath.display()),
        ));
    }
    if let Some(bad) = labs.data.iter().find(|&&l| l > 9) {
        return Err(ModelError::bad_file(&lpath, format!("label {bad} outside 0..9")));
    }
    Ok(Dataset {
        name: "fashion-mnist".into(),
        shape: ImageShape { channels: 1, height: imgs.dims[1], width: imgs.dims[2] },
        classes: 10,
        images: imgs.data.iter().map(|&p| p as f32 / 255.0).collect(),
        labels: labs.data,
    })
}
