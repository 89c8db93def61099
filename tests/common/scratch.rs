//! A test's own directory under the temporary directory, gone when the test passes. Shared
//! with the tools crate's tests (`#[path]`).

/// A fresh, empty directory for one test's files, named after the test, removed when the
/// returned guard drops — unless the test is failing, when it stays for a look and its path is
/// printed.
pub fn fresh_dir(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("ringzero-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// A test's own directory ([`fresh_dir`]); a path wherever one is taken.
pub struct Scratch(std::path::PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept for a look: {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
