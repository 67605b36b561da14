//! The one place npuc asks which SIMD instruction sets it may use.
//!
//! Kernels come in levels: a portable scalar twin that always works, an AVX2 (+FMA, F16C)
//! version, and (where written) an AVX-512 (F, BW, DQ, VL) version. [`Isa::detect`] is the level
//! the kernels run at: the best the CPU supports, capped by the `NPUC_ISA` environment variable
//! (`scalar`, `avx2`, `avx512`) so tests and benchmarks can force every level the host has.
//! It is probed once per process. The artifact's target check uses the same names
//! ([`Isa::features`]).
#![forbid(unsafe_code)]

use std::sync::OnceLock;

/// An instruction-set level; ordered, so `isa >= Isa::Avx2` means "AVX2 kernels may run".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust; always available.
    Scalar,
    /// AVX2 with FMA and F16C (x86-64-v3).
    Avx2,
    /// AVX-512 F, BW, DQ and VL on top of [`Isa::Avx2`] (x86-64-v4).
    Avx512,
}

/// The variable that caps the level: `scalar`, `avx2` or `avx512`.
pub const ENV: &str = "NPUC_ISA";

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The level kernels run at: [`Isa::host`], capped by `NPUC_ISA` when set. Probed once.
    /// An unparsable `NPUC_ISA` is reported once on stderr and ignored (kernels must not fail
    /// over an environment variable; tests that set it check [`Isa::from_env`] themselves).
    pub fn detect() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let host = Isa::host();
            match Isa::from_env() {
                Ok(Some(cap)) => cap.min(host),
                Ok(None) => host,
                Err(e) => {
                    eprintln!("npuc: {e}; using {}", host.name());
                    host
                }
            }
        })
    }

    /// The level this CPU supports (ignores `NPUC_ISA`). Probed once.
    pub fn host() -> Isa {
        static HOST: OnceLock<Isa> = OnceLock::new();
        *HOST.get_or_init(probe)
    }

    /// The cap `NPUC_ISA` asks for, if any.
    pub fn from_env() -> Result<Option<Isa>, String> {
        match std::env::var(ENV) {
            Ok(v) if !v.trim().is_empty() => Isa::parse(v.trim())
                .map(Some)
                .ok_or_else(|| format!("{ENV}={v} is not one of scalar, avx2, avx512")),
            _ => Ok(None),
        }
    }

    /// `scalar`, `avx2`, `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The inverse of [`Isa::name`] (case-insensitive).
    pub fn parse(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s))
    }

    /// Whether the AVX2 (+FMA, F16C) kernels may run at this level.
    pub fn has_avx2(self) -> bool {
        self >= Isa::Avx2
    }

    /// Whether the AVX-512 kernels may run at this level.
    pub fn has_avx512(self) -> bool {
        self >= Isa::Avx512
    }

    /// Whether the AVX-512 VNNI kernels (`vpdpbusd`) may run: the level allows AVX-512 and the
    /// CPU also has AVX-512 VNNI, which x86-64-v4 (this crate's `avx512` level) does not
    /// include; such a host keeps the AVX2 integer kernels.
    pub fn has_avx512_vnni(self) -> bool {
        self.has_avx512() && host_has("avx512vnni")
    }

    /// The CPU features this level assumes, as an artifact's target descriptor lists them.
    pub fn features(self) -> &'static [&'static str] {
        match self {
            Isa::Scalar => &[],
            Isa::Avx2 => &["avx2", "fma", "f16c"],
            Isa::Avx512 => &[
                "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
            ],
        }
    }

    /// Whether this CPU has every feature in `features` (names as in [`Isa::features`]; an
    /// unknown name is not present).
    pub fn host_has_all(features: &[String]) -> bool {
        features.iter().all(|f| host_has(f))
    }
}

/// Whether this CPU has the named feature.
pub fn host_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match feature {
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "fma" => std::arch::is_x86_feature_detected!("fma"),
            "f16c" => std::arch::is_x86_feature_detected!("f16c"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
            "avx512dq" => std::arch::is_x86_feature_detected!("avx512dq"),
            "avx512vl" => std::arch::is_x86_feature_detected!("avx512vl"),
            "avx512vnni" => std::arch::is_x86_feature_detected!("avx512vnni"),
            "avx512bf16" => std::arch::is_x86_feature_detected!("avx512bf16"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

fn probe() -> Isa {
    let all = |fs: &[&str]| fs.iter().all(|f| host_has(f));
    if all(Isa::Avx512.features()) {
        Isa::Avx512
    } else if all(Isa::Avx2.features()) {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_named() {
        assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        for i in Isa::ALL {
            assert_eq!(Isa::parse(i.name()), Some(i));
        }
        assert_eq!(Isa::parse("AVX2"), Some(Isa::Avx2));
        assert_eq!(Isa::parse("sse"), None);
        assert!(Isa::Avx512.has_avx2() && !Isa::Scalar.has_avx2());
    }

    #[test]
    fn detect_never_exceeds_the_host() {
        assert!(Isa::detect() <= Isa::host());
        assert!(Isa::host_has_all(
            &Isa::host()
                .features()
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
        ));
    }
}
