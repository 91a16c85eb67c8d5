//! The few `slurm_*` functions the plugin calls (Slurm's types are in [`super::records`]).
//!
//! The functions are not linked: librpmi.so must not pull in a second libslurm (the daemons and srun already
//! carry `libslurmfull`, with its own globals). They are looked up in the host process with
//! `dlsym(RTLD_DEFAULT)` once, before any fork, and called through the pointers found.

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code)]

use super::records::{
    job_info_msg_t, job_states_JOB_RUNNING, slurm_conf_t, slurm_step_id_t, DEBUG_FLAG_MPI, JOB_COMPLETING,
    JOB_STATE_BASE, SHOW_LOCAL, SLURM_SUCCESS,
};
use super::version::{self, ConfOption, KillJobStep, LoadJob};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

/// `int slurm_env_array_overwrite_fmt(char ***env, const char *name, const char *fmt, ...)`: 1 on success.
pub type EnvOverwriteFmt = unsafe extern "C" fn(*mut *mut *mut c_char, *const c_char, *const c_char, ...) -> c_int;
type UnsetEnvp = unsafe extern "C" fn(*mut *mut c_char, *const c_char);
type HostlistCreate = unsafe extern "C" fn(*const c_char) -> *mut c_void;
type HostlistShift = unsafe extern "C" fn(*mut c_void) -> *mut c_char;
type HostlistDestroy = unsafe extern "C" fn(*mut c_void);

/// Slurm's hostlist parser: create from a string, shift names (malloc'd, freed with free()), destroy.
#[derive(Clone, Copy)]
pub struct Hostlist {
    create: HostlistCreate,
    shift: HostlistShift,
    destroy: HostlistDestroy,
}
type LogFn = unsafe extern "C" fn(*const c_char, ...);
type StrError = unsafe extern "C" fn(c_int) -> *const c_char;
/// mpi.conf's parser (`src/common/parse_config.h`, not installed): `transfer_s_p_options(s_p_options_t
/// **full, s_p_options_t *options, int *full_cnt)`, `int s_p_get_string(char **, const char *key,
/// const s_p_hashtbl_t *)` (an `xstrdup`ed copy), `s_p_hashtbl_t *s_p_hashtbl_create(const s_p_options_t [])`
/// and `int s_p_parse_pair(s_p_hashtbl_t *, const char *key, const char *value)`.
type TransferOptions = unsafe extern "C" fn(*mut *mut ConfOption, *const ConfOption, *mut c_int);
type GetString = unsafe extern "C" fn(*mut *mut c_char, *const c_char, *const c_void) -> c_int;
type HashtblCreate = unsafe extern "C" fn(*const ConfOption) -> *mut c_void;
type ParsePair = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> c_int;
/// Slurm's allocator (`src/common/xmalloc.h`, `xstring.h`): what Slurm frees must come from it.
/// `void *slurm_xcalloc(size_t, size_t, bool clear, bool try, const char *file, int line, const char *func)`,
/// `char *xstrdup(const char *)`, `void slurm_xfree(void **)`.
type Xcalloc = unsafe extern "C" fn(usize, usize, bool, bool, *const c_char, c_int, *const c_char) -> *mut c_void;
type Xstrdup = unsafe extern "C" fn(*const c_char) -> *mut c_char;
type Xfree = unsafe extern "C" fn(*mut *mut c_void);
/// The list `mpi_p_conf_get_printable` returns (`src/common/list.h`, `read_config.h`): `list_t
/// *list_create(ListDelF)`, `list_append(list_t *, void *)` (22.05 returns the item, later lines nothing; the
/// return value is not read, which the x86_64 calling convention makes the same call), and
/// `destroy_config_key_pair(void *)`, the destructor Slurm's own plugins give such a list.
type ListCreate = unsafe extern "C" fn(Option<ListDel>) -> *mut c_void;
type ListAppend = unsafe extern "C" fn(*mut c_void, *mut c_void);
type ListDel = unsafe extern "C" fn(*mut c_void);
/// `char *get_extra_conf_path(char *conf_name)` (`src/common/read_config.h`; `const char *` in 26.05): the
/// path of a file beside slurm.conf, allocated with `xmalloc`.
type ExtraConfPath = unsafe extern "C" fn(*const c_char) -> *mut c_char;
/// `void slurm_free_job_info_msg(job_info_msg_t *msg)` (`<slurm/slurm.h>`).
type FreeJobInfoMsg = unsafe extern "C" fn(*mut job_info_msg_t);
/// `int slurm_conf_get_addr(const char *node_name, slurm_addr_t *address, uint16_t flags)`; `slurm_addr_t` is
/// a `struct sockaddr_storage`.
type ConfGetAddr = unsafe extern "C" fn(*const c_char, *mut libc::sockaddr_storage, u16) -> c_int;

/// The Slurm functions the plugin uses, as found in the host process (each may be missing outside Slurm).
pub struct Slurm {
    pub env_overwrite_fmt: Option<EnvOverwriteFmt>,
    unsetenvp: Option<UnsetEnvp>,
    kill_job_step: Option<KillJobStep>,
    load_job: Option<LoadJob>,
    free_job_info_msg: Option<FreeJobInfoMsg>,
    #[cfg(slurm_kill = "step_id")]
    signal_job_step: Option<version::SignalJobStep>,
    hostlist: Option<Hostlist>,
    error: Option<LogFn>,
    info: Option<LogFn>,
    verbose: Option<LogFn>,
    debug: Option<LogFn>,
    strerror: Option<StrError>,
    conf_get_addr: Option<ConfGetAddr>,
    transfer_options: Option<TransferOptions>,
    get_string: Option<GetString>,
    hashtbl_create: Option<HashtblCreate>,
    parse_pair: Option<ParsePair>,
    xcalloc: Option<Xcalloc>,
    xstrdup: Option<Xstrdup>,
    xfree: Option<Xfree>,
    list_create: Option<ListCreate>,
    list_append: Option<ListAppend>,
    destroy_key_pair: Option<ListDel>,
    extra_conf_path: Option<ExtraConfPath>,
    /// Slurm's `slurm_conf`: the process's configuration (a global of `src/common/read_config.h`).
    conf: Option<ConfPtr>,
}

/// The address of `slurm_conf`, found once and written only on the thread that loads the plugin.
struct ConfPtr(*mut slurm_conf_t);
// SAFETY: only read or written from `init` (see [`Slurm::quiet_mpi_debug`]), before the plugin starts a thread.
unsafe impl Send for ConfPtr {}
unsafe impl Sync for ConfPtr {}

/// `S_P_STRING` of `slurm_parser_enum_t` (the same in every supported line).
pub const S_P_STRING: c_int = 1;

/// `config_key_pair_t` (`src/common/read_config.h`, the same in every supported line): one line of
/// `scontrol show config`.
#[repr(C)]
struct KeyPair {
    name: *mut c_char,
    value: *mut c_char,
}

fn lookup(name: &CStr) -> *mut c_void {
    // SAFETY: dlsym with a NUL-terminated name; RTLD_DEFAULT searches the process's global scope.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// Whether this process is a slurmstepd (the plugin is loaded by slurmctld, slurmd and srun too): only
/// slurmstepd exports `stepd_step_rec_create` (its executable's name differs between distributions).
pub fn in_slurmstepd() -> bool {
    !lookup(c"stepd_step_rec_create").is_null()
}

macro_rules! find {
    ($name:literal) => {{
        let p = lookup($name);
        // SAFETY: the symbol, if present, is Slurm's function of the declared C type.
        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, _>(p) })
    }};
}

/// The functions, looked up on first use. First use is always before a fork (at `init`, prelaunch or
/// prefork): `dlsym` is not called in a forked child.
pub fn slurm() -> &'static Slurm {
    static SLURM: OnceLock<Slurm> = OnceLock::new();
    SLURM.get_or_init(|| Slurm {
        env_overwrite_fmt: find!(c"slurm_env_array_overwrite_fmt"),
        unsetenvp: find!(c"slurm_unsetenvp"),
        kill_job_step: find!(c"slurm_kill_job_step"),
        load_job: find!(c"slurm_load_job"),
        free_job_info_msg: find!(c"slurm_free_job_info_msg"),
        #[cfg(slurm_kill = "step_id")]
        signal_job_step: find!(c"slurm_signal_job_step"),
        hostlist: (|| {
            Some(Hostlist {
                create: find!(c"slurm_hostlist_create")?,
                shift: find!(c"slurm_hostlist_shift")?,
                destroy: find!(c"slurm_hostlist_destroy")?,
            })
        })(),
        error: find!(c"slurm_error"),
        info: find!(c"slurm_info"),
        verbose: find!(c"slurm_verbose"),
        debug: find!(c"slurm_debug"),
        strerror: find!(c"slurm_strerror"),
        conf_get_addr: find!(c"slurm_conf_get_addr"),
        transfer_options: find!(c"transfer_s_p_options"),
        get_string: find!(c"s_p_get_string"),
        hashtbl_create: find!(c"s_p_hashtbl_create"),
        parse_pair: find!(c"s_p_parse_pair"),
        xcalloc: find!(c"slurm_xcalloc"),
        xstrdup: find!(c"slurm_xstrdup"),
        xfree: find!(c"slurm_xfree"),
        list_create: find!(c"slurm_list_create"),
        list_append: find!(c"slurm_list_append"),
        destroy_key_pair: find!(c"slurm_destroy_config_key_pair"),
        extra_conf_path: find!(c"slurm_get_extra_conf_path"),
        conf: Some(lookup(c"slurm_conf")).filter(|p| !p.is_null()).map(|p| ConfPtr(p.cast())),
    })
}

fn c_text(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

impl Slurm {
    /// Logs into the process's Slurm log (the slurmd log for a stepd, stderr for srun), at `level`.
    /// Outside Slurm it goes to stderr.
    pub fn log(&self, level: log::Level, message: &str) {
        let f = match level {
            log::Level::Error | log::Level::Warn => self.error,
            log::Level::Info => self.info,
            log::Level::Debug => self.verbose,
            log::Level::Trace => self.debug,
        };
        let text = c_text(&format!("rpmi: {message}"));
        match f {
            // SAFETY: a printf-style Slurm logger called with "%s" and one NUL-terminated string.
            Some(f) => unsafe { f(c"%s".as_ptr(), text.as_ptr()) },
            None => eprintln!("rpmi: {message}"),
        }
    }

    /// Turns `DebugFlags=MPI` off in this process, and says whether it was on. In a slurmstepd Slurm logs the
    /// step's whole environment under that flag before `prefork` runs, and the environment carries the step's
    /// secret (`RPMI_SLURM_SECRET`): anyone who reads slurmd's log could then join or answer the step while
    /// it starts. Called from `init`, while Slurm loads the plugin, before any thread of the plugin runs.
    pub fn quiet_mpi_debug(&self) -> bool {
        let Some(ConfPtr(conf)) = self.conf else { return false };
        // SAFETY: `slurm_conf` is Slurm's `slurm_conf_t` (its layout from this Slurm's own slurm.h). slurmstepd loads
        // the plugin while it sets itself up, once it has its configuration from slurmd and before it serves the
        // step. The store is not made under Slurm's configuration lock, which is not exported: Slurm's threads
        // read the flags without it too, and an aligned u64 is stored whole.
        unsafe {
            let flags = std::ptr::addr_of_mut!((*conf).debug_flags);
            let on = *flags & DEBUG_FLAG_MPI != 0;
            *flags &= !DEBUG_FLAG_MPI;
            on
        }
    }

    pub fn error(&self, message: &str) {
        self.log(log::Level::Error, message)
    }

    pub fn info(&self, message: &str) {
        self.log(log::Level::Info, message)
    }

    /// Sets `name=value` in a Slurm environment array.
    ///
    /// # Safety
    /// `env` is a Slurm-allocated environment array pointer (`char ***`), as Slurm passes to the hooks.
    pub unsafe fn setenv(&self, env: *mut *mut *mut c_char, name: &CStr, value: &CStr) -> Result<(), String> {
        let f = self.env_overwrite_fmt.ok_or("slurm_env_array_overwrite_fmt is not in this process")?;
        // SAFETY: Slurm's own function on the caller's `char ***`, with "%s" and one NUL-terminated string.
        if unsafe { f(env, name.as_ptr(), c"%s".as_ptr(), value.as_ptr()) } == 1 {
            Ok(())
        } else {
            Err(format!("cannot set {} in the environment", name.to_string_lossy()))
        }
    }

    /// Removes `name` from a Slurm environment array, or, without Slurm's function, leaves it.
    ///
    /// # Safety
    /// `env` is NULL or a Slurm environment array (`char **`).
    pub unsafe fn unsetenv(&self, env: *mut *mut c_char, name: &CStr) {
        if let (Some(f), false) = (self.unsetenvp, env.is_null()) {
            // SAFETY: Slurm's own function on the caller's array (not NULL); the name is NUL-terminated.
            unsafe { f(env, name.as_ptr()) };
        }
    }

    /// Asks Slurm to signal every task of step `id` (`slurm_kill_job_step`), named as Slurm named it to the
    /// plugin (its sluid too, where the line has one), as Slurm's own MPI plugins do. A step of a hetjob's
    /// leader job (`leads_hetjob`) is signalled through its nodes' slurmds instead (`slurm_signal_job_step`)
    /// on the lines whose `slurm_kill_job_step` takes the step's id (25.11 on): slurmctld's sources there, asked
    /// to SIGKILL a step of the leader's job, cancel every component's whole job.
    pub fn kill_step(&self, id: &slurm_step_id_t, signal: i32, leads_hetjob: bool) -> Result<(), String> {
        let (job, step) = (id.job_id, id.step_id);
        #[cfg(slurm_kill = "step_id")]
        let rc = match (leads_hetjob, self.signal_job_step) {
            (true, Some(f)) => {
                let mut id = *id;
                // SAFETY: Slurm's slurm_signal_job_step, found by its name; `id` lives for the call.
                unsafe { f(&mut id, signal as u32) }
            }
            (true, None) => return Err("slurm_signal_job_step is not in this process".into()),
            (false, _) => self.kill_job_step(id, signal)?,
        };
        #[cfg(not(slurm_kill = "step_id"))]
        let rc = {
            // Where slurm_kill_job_step names the step by numbers, slurmctld ends that step in every component.
            let _ = leads_hetjob;
            self.kill_job_step(id, signal)?
        };
        if rc == SLURM_SUCCESS {
            return Ok(());
        }
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let why = match self.strerror {
            // SAFETY: Slurm's strerror returns a static string for any code.
            Some(f) => unsafe { CStr::from_ptr(f(errno)) }.to_string_lossy().into_owned(),
            None => format!("error {errno}"),
        };
        Err(format!("cannot end step {job}.{step}: {why}"))
    }

    /// Whether slurmctld is ending the job of step `id` (cancelled, timed out, failed, completing: anything but
    /// running), from `slurm_load_job` (one RPC, the federation not asked); `None` when it cannot say.
    pub fn job_ending(&self, id: &slurm_step_id_t) -> Option<bool> {
        let (load, free) = (self.load_job?, self.free_job_info_msg?);
        let mut msg: *mut job_info_msg_t = std::ptr::null_mut();
        // SAFETY: this line's slurm_load_job, found by its name, with a place for its answer.
        if unsafe { version::load_job(load, &mut msg, id, SHOW_LOCAL) } != SLURM_SUCCESS || msg.is_null() {
            return None;
        }
        // SAFETY: slurm_load_job's answer: `record_count` records at `job_array` (the job, and a hetjob's other
        // components after its leader), freed once read.
        let state = unsafe {
            let m = &*msg;
            let state = (m.record_count > 0 && !m.job_array.is_null()).then(|| (*m.job_array).job_state);
            free(msg);
            state
        }?;
        Some(state & JOB_COMPLETING != 0 || state & JOB_STATE_BASE != job_states_JOB_RUNNING)
    }

    /// `slurm_kill_job_step` of step `id`: Slurm's return code.
    fn kill_job_step(&self, id: &slurm_step_id_t, signal: i32) -> Result<c_int, String> {
        let f = self.kill_job_step.ok_or("slurm_kill_job_step is not in this process")?;
        // SAFETY: this line's slurm_kill_job_step, found by its name.
        Ok(unsafe { version::kill_job_step(f, id, signal as u16) })
    }

    /// Adds `options` (ending with a NULL key) to a plugin's mpi.conf options, as `mpi_p_conf_options` must.
    ///
    /// # Safety
    /// `full` and `count` as Slurm passes them to `mpi_p_conf_options`; `options` lives for the call.
    pub unsafe fn add_conf_options(&self, full: *mut *mut ConfOption, options: *const ConfOption, count: *mut c_int) {
        if let (Some(f), false) = (self.transfer_options, full.is_null() || count.is_null()) {
            // SAFETY: Slurm's function on the pointers Slurm handed over and our NULL-terminated options.
            unsafe { f(full, options, count) }
        }
    }

    /// The value of `key` (an `S_P_STRING` option) in an mpi.conf table, if it has one.
    ///
    /// # Safety
    /// `table` is NULL or an `s_p_hashtbl_t` Slurm handed to `mpi_p_conf_set`.
    pub unsafe fn conf_string(&self, table: *const c_void, key: &CStr) -> Option<String> {
        let (Some(get), Some(xfree)) = (self.get_string, self.xfree) else { return None };
        let mut copy: *mut c_char = std::ptr::null_mut();
        // SAFETY: Slurm's function on its table, a NUL-terminated key and a live pointer it sets to a copy.
        if table.is_null() || unsafe { get(&mut copy, key.as_ptr(), table) } != 1 || copy.is_null() {
            return None;
        }
        // SAFETY: Slurm's NUL-terminated copy, read then freed with Slurm's own free, once.
        unsafe {
            let value = CStr::from_ptr(copy).to_string_lossy().into_owned();
            xfree((&mut copy as *mut *mut c_char).cast());
            Some(value)
        }
    }

    /// A new mpi.conf table of `options` holding each `key=value` of `pairs`, for `mpi_p_conf_get` (Slurm
    /// frees it); NULL without Slurm's parser.
    ///
    /// # Safety
    /// `options` ends with a NULL key and lives for the call.
    pub unsafe fn conf_table(&self, options: *const ConfOption, pairs: &[(&CStr, CString)]) -> *mut c_void {
        let (Some(create), Some(parse)) = (self.hashtbl_create, self.parse_pair) else {
            return std::ptr::null_mut();
        };
        // SAFETY: Slurm's functions: a table made from our options, and NUL-terminated pairs.
        unsafe {
            let table = create(options);
            if !table.is_null() {
                for (key, value) in pairs {
                    // Values as `Site::passed_on` writes them, which the parser takes as they are.
                    if parse(table, key.as_ptr(), value.as_ptr()) == 0 {
                        self.error(&format!("mpi.conf: {key:?}={value:?} could not be passed on to the slurmstepds"));
                    }
                }
            }
            table
        }
    }

    /// A list of `name = value` lines as `mpi_p_conf_get_printable` returns it (Slurm frees it, each line
    /// with `destroy_config_key_pair`); NULL without Slurm's list and allocator.
    pub fn key_pairs(&self, pairs: &[(String, String)]) -> *mut c_void {
        let (Some(create), Some(append), Some(destroy), Some(xcalloc), Some(xstrdup)) =
            (self.list_create, self.list_append, self.destroy_key_pair, self.xcalloc, self.xstrdup)
        else {
            return std::ptr::null_mut();
        };
        // SAFETY: Slurm's list and allocator: each pair is allocated as Slurm's own plugins allocate theirs,
        // with strings Slurm copies from NUL-terminated ones, so that Slurm's destructor frees it.
        unsafe {
            let list = create(Some(destroy));
            if list.is_null() {
                return list;
            }
            for (name, value) in pairs {
                let size = std::mem::size_of::<KeyPair>();
                let pair = xcalloc(1, size, true, false, c"rpmi".as_ptr(), 0, c"key_pairs".as_ptr()).cast::<KeyPair>();
                let (name, value) = (c_text(name), c_text(value));
                (*pair).name = xstrdup(name.as_ptr());
                (*pair).value = xstrdup(value.as_ptr());
                append(list, pair.cast());
            }
            list
        }
    }

    /// The text (its first MiB) of the file `name` beside slurm.conf, if this process has Slurm's
    /// configuration and the file is there.
    pub fn extra_conf(&self, name: &CStr) -> Option<String> {
        use std::io::Read;
        let (f, xfree) = (self.extra_conf_path?, self.xfree?);
        // SAFETY: Slurm's function with a NUL-terminated name, which it only reads.
        let mut p = unsafe { f(name.as_ptr()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: Slurm's NUL-terminated path, copied then freed with Slurm's own free, once.
        let path = unsafe {
            let path = CStr::from_ptr(p).to_string_lossy().into_owned();
            xfree((&mut p as *mut *mut c_char).cast());
            path
        };
        let mut text = String::new();
        std::fs::File::open(path).ok()?.take(1 << 20).read_to_string(&mut text).ok()?;
        Some(text)
    }

    /// The address slurm.conf gives node `name` (its `NodeAddr`), if this process has Slurm's configuration.
    pub fn node_address(&self, name: &str) -> Option<std::net::IpAddr> {
        let f = self.conf_get_addr?;
        let name = CString::new(name).ok()?;
        // SAFETY: an all-zero sockaddr_storage is a valid (unspecified) address.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: Slurm fills the sockaddr_storage we own; the name is NUL-terminated.
        if unsafe { f(name.as_ptr(), &mut ss, 0) } != SLURM_SUCCESS {
            return None;
        }
        match c_int::from(ss.ss_family) {
            libc::AF_INET => {
                // SAFETY: the family says the storage holds a sockaddr_in.
                let sin = unsafe { &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
                Some(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into())
            }
            libc::AF_INET6 => {
                // SAFETY: the family says the storage holds a sockaddr_in6.
                let sin6 = unsafe { &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
                Some(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr).into())
            }
            _ => None,
        }
    }

    /// The names in a Slurm node list of at most `max` nodes (see [`expand_nodelist`]).
    pub fn expand_nodelist(&self, list: &str, max: usize) -> Result<Vec<String>, String> {
        expand_nodelist(list, max, self.hostlist)
    }
}

/// The names in a Slurm node list of at most `max` nodes, with Slurm's own parser (`hostlist`) when the
/// process has it. The list may come from the user's environment, and Slurm's parser builds every name
/// before it hands out the first (brackets one after another multiply: `a[0-65535]b[0-65535]` is 2^32 names,
/// some 370 GB) and ends the whole process on some lists (too many ranges). So a list longer than `max`
/// names can be written in, with more ranges than `max`, or that rpmi's own reading
/// ([`layout::expand_nodelist`](super::layout::expand_nodelist)) finds naming more than `max` nodes is
/// refused before Slurm's parser sees it; and one that Slurm reads as another number of names, after.
pub fn expand_nodelist(list: &str, max: usize, hostlist: Option<Hostlist>) -> Result<Vec<String>, String> {
    let bad = |why: String| format!("node list '{}': {why}", super::trace::escape_text(list, 200));
    if list.len() > max.saturating_mul(super::layout::NODE_NAME_MAX).saturating_add(1024) {
        return Err(bad(format!("{} bytes, too long for {max} nodes", list.len())));
    }
    // Each range or name is at least one node, and they are separated by commas.
    if list.bytes().filter(|&b| b == b',').count() >= max.max(1) {
        return Err(bad(format!("more ranges than {max} nodes")));
    }
    // Stops at max + 1 names, whatever the list multiplies to.
    let ours = super::layout::expand_nodelist(list, max)?;
    let Some(Hostlist { create, shift, destroy }) = hostlist else {
        return Ok(ours);
    };
    let text = c_text(list);
    // SAFETY: Slurm's hostlist API: create from a string, shift names (malloc'd, freed with free()),
    // destroy.
    unsafe {
        let hl = create(text.as_ptr());
        if hl.is_null() {
            return Err(bad("Slurm cannot read it".into()));
        }
        let mut names = Vec::new();
        loop {
            let p = shift(hl);
            if p.is_null() {
                break;
            }
            names.push(CStr::from_ptr(p).to_string_lossy().into_owned());
            libc::free(p.cast());
            if names.len() > max {
                destroy(hl);
                return Err(bad(format!("more than {max} names")));
            }
        }
        destroy(hl);
        if names.len() != ours.len() {
            return Err(bad(format!("Slurm reads {} names in it, rpmi {}", names.len(), ours.len())));
        }
        Ok(names)
    }
}

/// The value of `name` in a Slurm environment array (`char **`, NULL-terminated).
///
/// # Safety
/// `env` is NULL or a NULL-terminated array of NUL-terminated strings.
pub unsafe fn getenvp(env: *const *const c_char, name: &str) -> Option<String> {
    if env.is_null() {
        return None;
    }
    let mut p = env;
    loop {
        // SAFETY: `p` is within the array: it starts at `env` and moves on only past a non-NULL entry.
        let entry = unsafe { *p };
        if entry.is_null() {
            break;
        }
        // SAFETY: a non-NULL entry: a NUL-terminated string, as the caller's contract says.
        let entry = unsafe { CStr::from_ptr(entry) }.to_bytes();
        if entry.len() > name.len() && entry.starts_with(name.as_bytes()) && entry[name.len()] == b'=' {
            return Some(String::from_utf8_lossy(&entry[name.len() + 1..]).into_owned());
        }
        // SAFETY: past a non-NULL entry the array goes on, at least to its terminating NULL.
        p = unsafe { p.add(1) };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Where Debian's and EL's packages put Slurm's library, which exports its hostlist parser.
    const LIBSLURMFULL: [&CStr; 3] = [
        c"/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so",
        c"/usr/lib64/slurm/libslurmfull.so",
        c"/usr/lib/slurm/libslurmfull.so",
    ];

    static SLURMS_CREATE: OnceLock<HostlistCreate> = OnceLock::new();
    /// The lists Slurm's parser was given.
    static CREATED: AtomicUsize = AtomicUsize::new(0);

    /// Slurm's `slurm_hostlist_create`, counting its calls.
    unsafe extern "C" fn counted_create(text: *const c_char) -> *mut c_void {
        CREATED.fetch_add(1, Ordering::SeqCst);
        match SLURMS_CREATE.get() {
            // SAFETY: Slurm's function, given the caller's NUL-terminated text.
            Some(create) => unsafe { create(text) },
            None => std::ptr::null_mut(),
        }
    }

    /// Slurm's own hostlist parser, from its library (loaded locally: `slurm()` does not see it).
    fn slurms_hostlist() -> Hostlist {
        // SAFETY: dlopen of a path, dlsym of names, each NUL-terminated; the library stays loaded.
        let lib = LIBSLURMFULL
            .iter()
            .map(|path| unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) })
            .find(|h| !h.is_null())
            .expect("Slurm's libslurmfull.so (docker/install-deps.sh installs it)");
        let symbol = |name: &CStr| {
            // SAFETY: as above.
            let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
            assert!(!p.is_null(), "{name:?} in libslurmfull.so");
            p
        };
        // SAFETY: Slurm's functions of the declared C types.
        unsafe {
            let _ =
                SLURMS_CREATE.set(std::mem::transmute::<*mut c_void, HostlistCreate>(symbol(c"slurm_hostlist_create")));
            Hostlist {
                create: counted_create,
                shift: std::mem::transmute::<*mut c_void, HostlistShift>(symbol(c"slurm_hostlist_shift")),
                destroy: std::mem::transmute::<*mut c_void, HostlistDestroy>(symbol(c"slurm_hostlist_destroy")),
            }
        }
    }

    #[test]
    fn a_node_list_that_multiplies_past_the_step_never_reaches_slurms_parser() {
        let slurm = Some(slurms_hostlist());
        assert_eq!(expand_nodelist("n[1-3],m07", 4, slurm).unwrap(), ["n1", "n2", "n3", "m07"]);
        assert_eq!(CREATED.load(Ordering::SeqCst), 1, "Slurm's parser read the list");
        // The forms srun writes, which the two read alike.
        for (list, count) in [("n[09-10]", 2), ("rack[1-2]node[01-04]", 8), ("a.b.c,d-e,123", 3), ("12[3-4]", 2)] {
            assert_eq!(expand_nodelist(list, 8, slurm).map(|n| n.len()), Ok(count), "{list}");
        }
        let created = CREATED.load(Ordering::SeqCst);
        // 10^7 names in 22 bytes: Slurm's parser would build them all (860 MB) before handing out the first;
        // a[0-65535]b[0-65535] would be 2^32.
        let e = expand_nodelist("a[0-9999]b[0-999]c[0]", 3, slurm).unwrap_err();
        assert!(e.contains("more than 3 names"), "{e}");
        assert_eq!(CREATED.load(Ordering::SeqCst), created, "Slurm's parser was given the list");
        // Slurm takes a space as a separator too: a list the two read differently is refused.
        let e = expand_nodelist("n1 n2", 3, slurm).unwrap_err();
        assert!(e.contains("Slurm reads 2 names in it, rpmi 1"), "{e}");
    }
}
