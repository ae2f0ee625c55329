//! Fashion-MNIST (Zalando, MIT licence) read from IDX files, as installed by
//! Debian's `dataset-fashion-mnist` or unpacked by `shoal data fetch`.

use std::path::{Path, PathBuf};

use super::idx::{idx_file_dims, read_idx_file_rows};
use super::{Dataset, ImageShape, Samples, Split};
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
    let dir = fashion_dir_or_hint(data_dir)?;
    let train = load_pair(&dir, TRAIN_IMAGES, TRAIN_LABELS, None)?.0;
    let test = load_pair(&dir, TEST_IMAGES, TEST_LABELS, None)?.0;
    Ok(Split { train, test })
}

fn fashion_dir_or_hint(data_dir: Option<&Path>) -> Result<PathBuf> {
    fashion_mnist_dir(data_dir).ok_or_else(|| ModelError::DatasetMissing {
        name: "fashion-mnist".into(),
        hint: format!(
            "looked in {}; run `shoal data fetch fashion-mnist` or `scripts/fetch-data.sh`, \
             or pass --data-dir",
            match data_dir {
                Some(d) => d.display().to_string(),
                None => format!("./data and {SYSTEM_FASHION_MNIST_DIR}"),
            }
        ),
    })
}

const TRAIN_IMAGES: &str = "train-images-idx3-ubyte.gz";
const TRAIN_LABELS: &str = "train-labels-idx1-ubyte.gz";
const TEST_IMAGES: &str = "t10k-images-idx3-ubyte.gz";
const TEST_LABELS: &str = "t10k-labels-idx1-ubyte.gz";

/// Fashion-MNIST with its training images left on disk: the folder, the
/// test split, and the number of training samples. Only the training
/// images' header is read here (their count must match the labels');
/// [`load_fashion_train_rows`] reads, and checks, the samples a worker
/// trains on.
pub fn open_fashion_mnist(data_dir: Option<&Path>) -> Result<(PathBuf, Dataset, usize)> {
    let dir = fashion_dir_or_hint(data_dir)?;
    let ipath = dir.join(TRAIN_IMAGES);
    let dims = idx_file_dims(&ipath)?;
    if dims.len() != 3 {
        return Err(ModelError::bad_file(&ipath, format!("expected 3 dims, got {dims:?}")));
    }
    let lpath = dir.join(TRAIN_LABELS);
    let labels = read_idx_file_rows(&lpath, Some(&[]))?;
    if labels.file_rows != dims[0] {
        return Err(ModelError::bad_file(
            &lpath,
            format!("{} labels for {} images in {}", labels.file_rows, dims[0], ipath.display()),
        ));
    }
    let (test, _) = load_pair(&dir, TEST_IMAGES, TEST_LABELS, None)?;
    Ok((dir, test, dims[0]))
}

/// The training samples `rows` (ascending, no repeats) of the Fashion-MNIST
/// files in `dir`, and no others.
pub fn load_fashion_train_rows(dir: &Path, rows: &[usize]) -> Result<Dataset> {
    Ok(load_pair(dir, TRAIN_IMAGES, TRAIN_LABELS, Some(rows))?.0)
}

/// Load one images/labels pair (only `rows` of them, when given) and check
/// that they agree; also returns how many samples the files hold.
pub fn load_pair(dir: &Path, images: &str, labels: &str, rows: Option<&[usize]>) -> Result<(Dataset, usize)> {
    let ipath = dir.join(images);
    let lpath = dir.join(labels);
    let imgs = read_idx_file_rows(&ipath, rows)?;
    let labs = read_idx_file_rows(&lpath, rows)?;
    if imgs.dims.len() != 3 {
        return Err(ModelError::bad_file(&ipath, format!("expected 3 dims, got {:?}", imgs.dims)));
    }
    if labs.dims.len() != 1 {
        return Err(ModelError::bad_file(&lpath, format!("expected 1 dim, got {:?}", labs.dims)));
    }
    if imgs.file_rows != labs.file_rows {
        return Err(ModelError::bad_file(
            &lpath,
            format!("{} labels for {} images in {}", labs.file_rows, imgs.file_rows, ipath.display()),
        ));
    }
    if let Some(bad) = labs.data.iter().find(|&&l| l > 9) {
        return Err(ModelError::bad_file(&lpath, format!("label {bad} outside 0..9")));
    }
    let samples = imgs.file_rows;
    let data = Dataset {
        name: "fashion-mnist".into(),
        shape: ImageShape { channels: 1, height: imgs.dims[1], width: imgs.dims[2] },
        classes: 10,
        samples: Samples::Bytes(imgs.data),
        divisor: 255.0,
        labels: labs.data,
    };
    Ok((data, samples))
}
