//! The floating-point environment a run executes in: subnormal (denormal) f32 values flushed
//! to zero, as onnxruntime's `session.set_denormal_as_zero`, TensorFlow and
//! `torch.set_flush_denormal` do.
//!
//! Why: on x86 an SSE/AVX operation whose input or result is subnormal (|x| < 1.18e-38) takes a
//! microcode assist of ~100+ cycles instead of 4. A real model can produce them all the time:
//! PP-OCRv5's text-direction classifier has a dead stem channel (weights ~1e-41 scaled by a
//! BatchNorm of 1832), whose image products are subnormal, and the assists cascade through the
//! HardSwish and depthwise conv after it: 0.98 ms for a 1.4 MMAC conv that takes 0.13 ms with
//! those weights zeroed. Flushing changes only values below 1.18e-38 (a relative change no
//! f32 tolerance can see), so it is on by default; `NPUC_DENORMALS=keep` turns it off.
//!
//! Two MXCSR bits: FTZ (bit 15) writes subnormal results as zero, DAZ (bit 6) reads subnormal
//! inputs as zero. Other architectures keep their default environment.

/// Whether runs flush subnormals unless told otherwise: on, except with `NPUC_DENORMALS=keep`.
pub fn flush_by_default() -> bool {
    !std::env::var("NPUC_DENORMALS").is_ok_and(|v| v.eq_ignore_ascii_case("keep"))
}

#[cfg(target_arch = "x86_64")]
mod imp {
    const FTZ: u32 = 1 << 15;
    const DAZ: u32 = 1 << 6;

    pub fn read() -> u32 {
        let mut csr: u32 = 0;
        // SAFETY: `stmxcsr` stores the 32-bit MXCSR register into the 4 bytes behind the
        // pointer, which is a valid, aligned local; SSE is part of the x86_64 baseline.
        unsafe {
            core::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags))
        };
        csr
    }

    pub fn write(csr: u32) {
        // SAFETY: `ldmxcsr` loads MXCSR from a valid, aligned local. The only values written
        // are ones read from MXCSR with the FTZ/DAZ bits changed (never reserved bits, which
        // would fault). Rust's float semantics assume the default environment: with FTZ/DAZ
        // set, an operation on subnormals gives zero where compile-time evaluation would give
        // the subnormal; both are within any tolerance a model's f32 results are held to, and
        // no memory safety depends on float results.
        unsafe {
            core::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags))
        };
    }

    pub fn with_flush(csr: u32) -> u32 {
        csr | FTZ | DAZ
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    pub fn read() -> u32 {
        0
    }
    pub fn write(_: u32) {}
    pub fn with_flush(csr: u32) -> u32 {
        csr
    }
}

/// Sets flush-to-zero and denormals-are-zero on this thread for good (the session's own worker
/// threads, which run nothing else).
pub fn flush_on_this_thread() {
    imp::write(imp::with_flush(imp::read()));
}

/// Flush-to-zero on the current thread while it lives; the thread's previous environment is
/// restored on drop (the caller's thread may belong to an application with its own settings).
pub struct FlushDenormals {
    saved: u32,
}

impl FlushDenormals {
    pub fn new() -> FlushDenormals {
        let saved = imp::read();
        let flushed = imp::with_flush(saved);
        if flushed != saved {
            imp::write(flushed);
        }
        FlushDenormals { saved }
    }
}

impl Default for FlushDenormals {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FlushDenormals {
    fn drop(&mut self) {
        // Compare the control bits only: the low six are status flags the run set.
        if imp::read() & !0x3f != self.saved & !0x3f {
            imp::write(self.saved);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subnormal product flushes to zero inside the guard and is kept outside it, and the
    /// guard restores the thread's environment.
    #[test]
    fn guard_flushes_subnormals_and_restores_the_environment() {
        let tiny = std::hint::black_box(3.0e-38f32);
        let half = std::hint::black_box(0.25f32);
        // The low six bits are sticky status flags that float operations set; compare controls.
        let controls = || imp::read() & !0x3f;
        let before = controls();
        let kept = tiny * half;
        assert!(kept > 0.0 && !kept.is_normal(), "{kept:e}");
        let flushed = {
            let _g = FlushDenormals::new();
            std::hint::black_box(tiny) * std::hint::black_box(half)
        };
        assert_eq!(controls(), before);
        if cfg!(target_arch = "x86_64") {
            assert_eq!(flushed, 0.0);
            // DAZ: a subnormal input reads as zero.
            let sub = std::hint::black_box(kept);
            let _g = FlushDenormals::new();
            assert!(std::hint::black_box(sub) <= 0.0);
        } else {
            assert_eq!(flushed, kept);
        }
        assert_eq!(tiny * half, kept);
    }
}
