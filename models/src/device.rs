//! Choosing the candle device, with errors that say which feature to enable.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::error::{ModelError, Result};

/// Where tensors live. Parsed from `cpu`, `cuda`, `cuda:1`, `metal`, `metal:0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda(usize),
    Metal(usize),
}

impl FromStr for DeviceKind {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let (name, ordinal) = match s.split_once(':') {
            Some((n, o)) => {
                let ordinal = o.parse::<usize>().map_err(|_| ModelError::Device {
                    requested: s.to_string(),
                    reason: format!("`{o}` is not a device ordinal"),
                })?;
                (n, ordinal)
            }
            None => (s, 0),
        };
        match name.to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" | "gpu" => Ok(DeviceKind::Cuda(ordinal)),
            "metal" => Ok(DeviceKind::Metal(ordinal)),
            _ => Err(ModelError::Device {
                requested: s.to_string(),
                reason: "expected cpu, cuda[:N] or metal[:N]".to_string(),
            }),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceKind::Cpu => write!(f, "cpu"),
            DeviceKind::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceKind::Metal(i) => write!(f, "metal:{i}"),
        }
    }
}

impl From<DeviceKind> for String {
    fn from(d: DeviceKind) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for DeviceKind {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl DeviceKind {
    /// Open the device. A backend that was not compiled in is a clear error
    /// naming the cargo feature, not a panic deep inside candle.
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda(ordinal) => {
                if !cfg!(feature = "cuda") {
                    return Err(ModelError::Device {
                        requested: self.to_string(),
                        reason: "this shoal was built without CUDA support; rebuild with \
                                 `cargo build --release -p shoal-node --features cuda`"
                            .to_string(),
                    });
                }
                Device::new_cuda(ordinal)
                    .map_err(|e| ModelError::Device { requested: self.to_string(), reason: e.to_string() })
            }
            DeviceKind::Metal(ordinal) => {
                if !cfg!(feature = "metal") {
                    return Err(ModelError::Device {
                        requested: self.to_string(),
                        reason: "this shoal was built without Metal support; rebuild with \
                                 `cargo build --release -p shoal-node --features metal`"
                            .to_string(),
                    });
                }
                Device::new_metal(ordinal)
                    .map_err(|e| ModelError::Device { requested: self.to_string(), reason: e.to_string() })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<DeviceKind>().ok(), Some(DeviceKind::Cpu));
        assert_eq!("cuda:2".parse::<DeviceKind>().ok(), Some(DeviceKind::Cuda(2)));
        assert_eq!("metal".parse::<DeviceKind>().ok(), Some(DeviceKind::Metal(0)));
        assert!("tpu".parse::<DeviceKind>().is_err());
        assert!("cuda:x".parse::<DeviceKind>().is_err());
        // Config files use the same spelling as the command line.
        let d: std::result::Result<DeviceKind, _> = serde_json::from_str("\"cuda:1\"");
        assert_eq!(d.ok(), Some(DeviceKind::Cuda(1)));
        assert_eq!(serde_json::to_string(&DeviceKind::Metal(0)).ok().as_deref(), Some("\"metal:0\""));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn missing_cuda_names_the_feature() {
        let err = DeviceKind::Cuda(0).open().err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("--features cuda")));
    }
}
