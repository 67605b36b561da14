//! Low-level compute kernels shared by op implementations: SIMD micro-kernels with scalar
//! twins, selected at run time by CPU feature detection.

pub mod act;
pub mod align_alloc;
pub mod blockq4;
pub mod conv_nhwc;
pub mod fmap;
pub mod fpenv;
pub mod hist;
pub mod idwconv;
pub mod igemm;
pub mod imm;
pub mod interleave;
pub mod lut8;
pub mod qconvert;
pub mod qgemv;
pub mod sgemm;
pub mod sgemv;

/// One xorshift64 step: the kernels' property tests draw their operands from it.
#[cfg(test)]
pub(crate) fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

#[cfg(test)]
mod levels {
    use npuc_isa::Isa;

    /// The kernels' unit tests compare each dispatched loop with its scalar twin at the level
    /// this process runs at. Run without `NPUC_ISA`, this re-runs every `kernels::` test in
    /// child processes at each lower level the host has, so one `cargo test` covers the
    /// AVX-512, AVX2 and scalar dispatch alike (`tests/igemm.rs` does the same for its file).
    #[test]
    fn kernel_tests_pass_at_every_isa_level_the_host_has() {
        if std::env::var_os(npuc_isa::ENV).is_some() {
            return; // a child (or a run pinned to one level): the level under test.
        }
        let exe = std::env::current_exe().expect("the test binary's path");
        for level in Isa::ALL.into_iter().filter(|&l| l < Isa::detect()) {
            let out = std::process::Command::new(&exe)
                .env(npuc_isa::ENV, level.name())
                .args([
                    "kernels::",
                    "--skip",
                    "kernel_tests_pass_at_every_isa_level",
                ])
                .output()
                .expect("re-running the test binary");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "kernel tests at NPUC_ISA={} failed:\n{text}\n{}",
                level.name(),
                String::from_utf8_lossy(&out.stderr)
            );
            // Every test the child selected passed, and it selected the kernels' tests (17 when
            // this was written; the bound only guards against a filter that matches nothing).
            let count = |prefix: &str, line_end: &str| -> usize {
                text.lines()
                    .find_map(|l| l.strip_prefix(prefix))
                    .and_then(|l| l.split(line_end).next())
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0)
            };
            let (running, passed) = (count("running ", " "), count("test result: ok. ", " "));
            assert!(
                running >= 10 && passed == running,
                "NPUC_ISA={}: expected the kernel tests to run and pass, found:\n{text}",
                level.name()
            );
            eprintln!("NPUC_ISA={}: {passed} kernel tests passed", level.name());
        }
    }
}
