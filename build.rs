//! Generates the Rust side of the plugin ABI from `plugin-spec/rpmi_plugin.h` (through `wrapper.h`).

use std::env;
use std::path::{Path, PathBuf};

/// What differs between the Slurm release lines the plugin supports, as independent choices, each a cfg that
/// `src/slurm/version.rs` and `src/slurm/records.rs` read (that file's table says what each means). The size
/// of `slurm_step_id_t` comes from the headers themselves; `sluid` is what each line's sources give, asserted
/// against it.
struct Line {
    major: u32,
    minor: u32,
    /// `slurm_step_id_t` starts with the job's `sluid` (24 bytes, not 12).
    sluid: bool,
    /// The task info has 22.05's `self` pointer.
    task_self: bool,
    /// mpi.conf's option struct has `pack` and `unpack`.
    conf_pack: bool,
    /// How `slurm_kill_job_step` names the step: `ids` (job, step, signal), `ids_flags` (and flags), `step_id`
    /// (a `slurm_step_id_t *`, signal, flags).
    kill: &'static str,
    /// The step record's I/O thread: `ioid` (22.05) or `io_running` with its condition and mutex.
    io: &'static str,
    /// The step record still has `run_prolog`.
    run_prolog: bool,
    /// The step record has the job's `node_addrs` and `node_list` after `node_tasks`.
    node_list: bool,
    /// The step record has `het_job_step_task_cnts` before `het_job_task_offset`.
    het_step_tasks: bool,
    /// `slurm_load_job` takes the job's `slurm_step_id_t` by value, not its number.
    load_job_step_id: bool,
}

const fn line(major: u32, minor: u32, sluid: bool, kill: &'static str, run_prolog: bool) -> Line {
    let het_step_tasks = major > 25 || (major == 25 && minor >= 5);
    let load_job_step_id = major >= 26;
    Line {
        major,
        minor,
        sluid,
        task_self: false,
        conf_pack: true,
        kill,
        io: "io_running",
        run_prolog,
        node_list: true,
        het_step_tasks,
        load_job_step_id,
    }
}

const SLURM_LINES: &[Line] = &[
    Line {
        major: 22,
        minor: 5,
        sluid: false,
        task_self: true,
        conf_pack: false,
        kill: "ids",
        io: "ioid",
        run_prolog: true,
        node_list: false,
        het_step_tasks: false,
        load_job_step_id: false,
    },
    line(23, 11, false, "ids_flags", true),
    line(24, 5, false, "ids_flags", true),
    line(24, 11, true, "ids_flags", true),
    line(25, 5, true, "ids_flags", true),
    line(25, 11, true, "step_id", true),
    line(26, 5, true, "step_id", false),
];

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=plugin-spec/rpmi_plugin.h");
    for cfg in [
        "cfg(slurm_sluid, slurm_task_self, slurm_conf_pack, slurm_run_prolog, slurm_node_list, slurm_het_step_tasks, \
         slurm_load_job_step_id)",
        "cfg(slurm_kill, values(\"ids\", \"ids_flags\", \"step_id\"))",
        "cfg(slurm_io, values(\"ioid\", \"io_running\"))",
    ] {
        println!("cargo::rustc-check-cfg={cfg}");
    }
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_type("rpmi_.*")
        .allowlist_function("rpmi_.*")
        .allowlist_var("RPMI_.*")
        // The header's codes are ints; keep them signed so they compare with the functions' int results.
        .default_macro_constant_type(bindgen::MacroTypeVariation::Signed)
        .generate()
        .unwrap_or_else(|e| panic!("bindgen could not read plugin-spec/rpmi_plugin.h: {e}"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("rpmi_plugin.rs");
    bindings.write_to_file(&out).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
    if env::var_os("CARGO_FEATURE_SLURM").is_some() {
        slurm_bindings();
    }
}

/// The `slurm` feature: the few public Slurm types and constants `src/slurm/` reads, from `<slurm/slurm.h>`
/// under the Slurm headers' directory ([`slurm_include`]), so that `plugin_version` always matches the Slurm
/// the plugin is built against; and the release line's choices, from the same headers, as cfgs.
fn slurm_bindings() {
    let include = slurm_include();
    println!("cargo:rerun-if-changed={}", include.join("slurm/slurm.h").display());
    let line = slurm_line(&include);
    let flags = [
        ("slurm_sluid", line.sluid),
        ("slurm_task_self", line.task_self),
        ("slurm_conf_pack", line.conf_pack),
        ("slurm_run_prolog", line.run_prolog),
        ("slurm_node_list", line.node_list),
        ("slurm_het_step_tasks", line.het_step_tasks),
        ("slurm_load_job_step_id", line.load_job_step_id),
    ];
    for (cfg, set) in flags {
        if set {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
    println!("cargo::rustc-cfg=slurm_kill=\"{}\"", line.kill);
    println!("cargo::rustc-cfg=slurm_io=\"{}\"", line.io);
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg("-DRPMI_SLURM")
        // Searched before /usr/include, so that a host's own libslurm-dev cannot shadow the headers asked for;
        // only their slurm/ (a chroot's libc headers would not match this system's).
        .clang_arg(format!("-I{}", slurm_only(&include).display()))
        .allowlist_type("slurm_step_layout_t")
        .allowlist_type("slurm_step_id_t")
        .allowlist_type("slurm_conf_t")
        .allowlist_type("job_info_msg_t")
        .allowlist_type("job_states")
        .allowlist_var("JOB_STATE_BASE")
        .allowlist_var("SLURM_VERSION_NUMBER")
        .allowlist_var("NO_VAL")
        .allowlist_var("SLURM_SUCCESS")
        .allowlist_var("SLURM_ERROR")
        .generate()
        .unwrap_or_else(|e| {
            panic!("bindgen could not read {}/slurm/slurm.h (is libslurm-dev installed?): {e}", include.display())
        });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("slurm.rs");
    bindings.write_to_file(&out).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// The directory that holds Slurm's `slurm/` headers: `SLURM_INCLUDE_DIR` if set, else what `pkg-config slurm`
/// says (SchedMD's packages install `slurm.pc`), else `/usr/include` (Debian's libslurm-dev).
fn slurm_include() -> PathBuf {
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    if let Some(dir) = env::var_os("SLURM_INCLUDE_DIR") {
        return dir.into();
    }
    let pkg_config = std::process::Command::new("pkg-config").args(["--variable=includedir", "slurm"]).output();
    match pkg_config {
        Ok(out) if out.status.success() && !out.stdout.trim_ascii().is_empty() => {
            PathBuf::from(String::from_utf8_lossy(out.stdout.trim_ascii()).into_owned())
        }
        _ => "/usr/include".into(),
    }
}

/// A directory in OUT_DIR that holds only `slurm/`, a link to `<include>/slurm`.
fn slurm_only(include: &Path) -> PathBuf {
    let dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("slurm-include");
    let link = dir.join("slurm");
    let _ = std::fs::remove_file(&link);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot make {}: {e}", dir.display()));
    std::os::unix::fs::symlink(include.join("slurm"), &link)
        .unwrap_or_else(|e| panic!("cannot link {}: {e}", link.display()));
    dir
}

/// The supported release line `<include>/slurm/slurm_version.h` names; any other fails the build, since the
/// private structs Slurm hands the plugin are laid out per line.
fn slurm_line(include: &Path) -> &'static Line {
    let path = include.join("slurm/slurm_version.h");
    println!("cargo:rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; install libslurm-dev, or set SLURM_INCLUDE_DIR to the directory that holds slurm/",
            path.display()
        )
    });
    let number = text
        .lines()
        .find_map(|line| {
            let mut words = line.split_whitespace();
            let define = words.next() == Some("#define") && words.next() == Some("SLURM_VERSION_NUMBER");
            define.then(|| words.next()).flatten()
        })
        .and_then(|v| u32::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        .unwrap_or_else(|| panic!("{} has no `#define SLURM_VERSION_NUMBER 0x...`", path.display()));
    let (major, minor, micro) = (number >> 16 & 0xff, number >> 8 & 0xff, number & 0xff);
    let supported: Vec<String> = SLURM_LINES.iter().map(|l| format!("{}.{:02}", l.major, l.minor)).collect();
    if (major, minor) == (23, 2) {
        panic!(
            "the Slurm plugin does not support Slurm 23.02 (found {major}.{minor:02}.{micro} in {}): that line, out of \
             SchedMD's support, mixes 22.05's task info and slurm_kill_job_step with the newer mpi.conf options \
             and step record, and changed the step record within the line (at 23.02.1). Supported: {}.",
            path.display(),
            supported.join(", ")
        );
    }
    SLURM_LINES.iter().find(|l| (l.major, l.minor) == (major, minor)).unwrap_or_else(|| {
        panic!(
            "the Slurm plugin does not support Slurm {major}.{minor:02}.{micro} (SLURM_VERSION_NUMBER {number:#08x} \
             in {}): it supports {}. Another release line needs its entry in build.rs's SLURM_LINES, each choice \
             read from that release's sources: slurm_step_id_t in slurm/slurm.h, the task info passed to \
             mpi_p_slurmstepd_task and slurm_kill_job_step in src/interfaces/mpi.h and slurm/slurm.h, \
             s_p_options_t in src/common/parse_config.h, and stepd_step_rec_t in \
             src/slurmd/slurmstepd/slurmstepd_job.h (see src/slurm/version.rs).",
            path.display(),
            supported.join(", ")
        )
    })
}
