//! Files that appear whole or not at all: written under a temporary name in the same directory,
//! flushed to disk, renamed over the final name, and the directory entry flushed too. A reader (or
//! a crash) never sees half a file. Flight records and ZeRO checkpoints are written this way.

use std::io;
use std::path::{Path, PathBuf};

/// Write `path` through `write`, which creates the file at the temporary path it is given (in
/// the same directory, so the rename cannot cross filesystems). On error the temporary file is
/// removed and `path` is untouched.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<PathBuf> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} names no file", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let done = write(&tmp)
        .and_then(|()| {
            // Writers that go through a temporary file of their own (safetensors') leave it mode
            // 0600; the result is an ordinary file, readable as the umask allows.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o666 & !umask()))
        })
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename is durable only once the directory is flushed; a failure here leaves a complete
    // file in place, so it is not worth failing the write for.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(path.to_path_buf())
}

/// This process's umask, read from `/proc/self/status` (setting it to read it would race with
/// other threads creating files); 022 where it cannot be read.
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("Umask:"))?;
            u32::from_str_radix(line.split_whitespace().nth(1)?, 8).ok()
        })
        .unwrap_or(0o022)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_whole_files_and_leaves_nothing_on_error() {
        let dir = std::env::temp_dir().join(format!("ringzero-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.json");
        write_atomically(&p, |t| std::fs::write(t, b"one")).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        let e = write_atomically(&p, |t| {
            std::fs::write(t, b"half")?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "disk full");
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"one",
            "the old file is untouched"
        );
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_written_through_a_private_temporary_gets_the_umasks_mode() {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let dir = std::env::temp_dir().join(format!("ringzero-mode-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("shard.safetensors");
        write_atomically(&p, |t| {
            let mut o = std::fs::OpenOptions::new();
            o.write(true).create_new(true).mode(0o600);
            std::io::Write::write_all(&mut o.open(t)?, b"x")
        })
        .unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask(), "mode {mode:o}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
