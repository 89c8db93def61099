//! One message, one write. Ranks share a terminal (under `ringzero launch`, rank 0 writes to it
//! directly while the launcher writes the other ranks' prefixed lines), and `eprintln!` on the
//! unbuffered stderr makes a write per piece of its format, so two processes' lines interleave
//! mid-line. Every line the tools print to stderr goes through [`err_line`] instead: formatted
//! first, then written whole (one `write` of up to a pipe's atomic size).

use std::io::Write;

/// `msg` and a newline, as one buffer.
fn line(msg: &str) -> Vec<u8> {
    let mut line = Vec::with_capacity(msg.len() + 1);
    line.extend_from_slice(msg.as_bytes());
    line.push(b'\n');
    line
}

/// Write `msg` and a newline to stderr in one write.
pub fn err_line(msg: &str) {
    let _ = std::io::stderr().lock().write_all(&line(msg));
}

/// Write `msg` and a newline to stdout in one write (stdout is line-buffered already; this is
/// for lines built from a rank's output, which may hold no newline of their own).
pub fn out_line(msg: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&line(msg));
    let _ = out.flush();
}

/// `eprintln!` as one write: [`err_line`] of the formatted message.
#[macro_export]
macro_rules! eline {
    ($($arg:tt)*) => {
        $crate::console::err_line(&format!($($arg)*))
    };
}
