//! How `npuc` shows the driver's progress: an indicatif spinner per step when stderr is a
//! terminal, and one plain line per finished step (and per note) on stderr either way; a bar
//! while calibrating unless `--no-progress`.

use npuc_driver::Progress;

pub struct TermProgress {
    spinner: Option<indicatif::ProgressBar>,
    tty: bool,
    calibration_bar: bool,
    calibration: Option<indicatif::ProgressBar>,
}

impl TermProgress {
    /// Spinners on a terminal; a calibration bar when `calibration_bar`.
    pub fn new(calibration_bar: bool) -> TermProgress {
        use std::io::IsTerminal;
        TermProgress {
            spinner: None,
            tty: std::io::stderr().is_terminal(),
            calibration_bar,
            calibration: None,
        }
    }

    fn clear(&mut self) {
        if let Some(b) = self.spinner.take() {
            b.finish_and_clear();
        }
    }
}

impl Progress for TermProgress {
    fn start(&mut self, msg: &str) {
        self.clear();
        if self.tty {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(100));
            b.set_message(msg.to_string());
            self.spinner = Some(b);
        }
    }

    fn update(&mut self, msg: &dyn Fn() -> String) {
        if let Some(b) = &self.spinner {
            b.set_message(msg());
        }
    }

    fn done(&mut self, line: &str) {
        self.clear();
        eprintln!("{line}");
    }

    fn note(&mut self, msg: &str) {
        match &self.spinner {
            Some(b) => b.suspend(|| eprintln!("{msg}")),
            None => eprintln!("{msg}"),
        }
    }

    fn calibrated(&mut self, done: usize, total: usize) {
        if !self.calibration_bar {
            return;
        }
        let b = self.calibration.get_or_insert_with(|| {
            let b = indicatif::ProgressBar::new(total as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "calibrating {bar:40} {pos}/{len} samples {elapsed_precise}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        });
        b.set_position(done as u64);
    }

    fn calibration_done(&mut self) {
        if let Some(b) = self.calibration.take() {
            b.finish_and_clear();
        }
    }
}

impl Drop for TermProgress {
    fn drop(&mut self) {
        self.clear();
        self.calibration_done();
    }
}
