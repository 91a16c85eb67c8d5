//! [`CHost`]: the engine's [`Host`] implemented by calling a C host's `rpmi_host_ops`.

use super::ffi::{self, rpmi_host_ops, rpmi_instance};
use crate::driver::{DriverHandle, Event};
use crate::server::{Direction, Host, HostReply, HostRequest, JobError, Offered, Service, TaskId};
use crate::wire::SpawnRequest;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

/// Which service each local task waits for, so that a C host's untyped answer can be read
/// (`service_complete` comes from any thread; the request was made on the driver's).
pub type PendingServices = Arc<Mutex<Vec<Option<Service>>>>;

/// Reads a C host's untyped answer (`service_complete`) to `service`.
pub fn read_reply(service: Service, ok: bool, result: Option<String>) -> HostReply {
    match (ok, service) {
        (false, _) => HostReply::Failed(result.unwrap_or_else(|| "the resource manager failed it".into())),
        (true, Service::Publish | Service::Unpublish) => HostReply::Done,
        (true, Service::Lookup) => match result {
            Some(port) => HostReply::Port(port),
            None => HostReply::Failed("the resource manager found no port".into()),
        },
        (true, Service::Spawn) => {
            let codes: Result<Vec<i32>, _> =
                result.as_deref().unwrap_or("").split(',').filter(|s| !s.is_empty()).map(str::parse).collect();
            match codes {
                Ok(errcodes) => HostReply::Spawned { errcodes },
                Err(_) => HostReply::Failed("the resource manager gave malformed spawn error codes".into()),
            }
        }
    }
}

/// A C host, as the engine sees it.
pub struct CHost {
    pub ops: rpmi_host_ops,
    /// The instance handed back to every callback (set once the instance is boxed).
    pub instance: *mut rpmi_instance,
    /// Set once the node exists (its driver's handle).
    pub handle: Option<DriverHandle>,
    pub pending: PendingServices,
}

// SAFETY: the ABI obliges the host's callbacks (and host_data) to be usable from the plugin's progress thread
// (plugin-spec/README.md, "Threads"); the instance pointer is only passed back to them.
unsafe impl Send for CHost {}

impl CHost {
    /// Has the C host's table got `field` (it may be an older, shorter table)?
    fn has(&self, end_of_field: usize) -> bool {
        self.ops.struct_size as usize >= end_of_field
    }

    fn post(&self, event: Event) {
        // Fails only when the driver is gone, and then there is nobody to answer.
        if let Some(h) = &self.handle {
            let _ = h.post(event);
        }
    }

    fn start(&self, task: TaskId, service: Service, call: impl FnOnce() -> i32) -> Offered {
        if let Ok(mut p) = self.pending.lock() {
            if let Some(slot) = p.get_mut(task) {
                *slot = Some(service);
            }
        }
        let rc = call();
        if rc != ffi::RPMI_OK {
            // Refused now: a late service_complete for it must find nothing waiting.
            if let Ok(mut p) = self.pending.lock() {
                if let Some(slot) = p.get_mut(task) {
                    *slot = None;
                }
            }
            self.post(Event::HostReply(task, HostReply::Failed(format!("the resource manager refused it ({rc})"))));
        }
        Offered::Yes
    }
}

macro_rules! end_of {
    ($field:ident) => {
        std::mem::offset_of!(rpmi_host_ops, $field) + std::mem::size_of::<usize>()
    };
}

/// `message` followed by a NUL, so that a C host that treats it as a string (even an empty one) stays in
/// bounds; the length passed excludes the NUL.
fn nul_terminated(message: &str) -> Vec<u8> {
    let mut text = Vec::with_capacity(message.len() + 1);
    text.extend_from_slice(message.as_bytes());
    text.push(0);
    text
}

fn c_string(s: &str) -> CString {
    // Services and ports are RFC 13 words, which hold no NUL; a NUL would only cut the text short.
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

impl Host for CHost {
    fn collective(&mut self, contribution: &[u8]) {
        let rc = match self.ops.collective {
            // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
            Some(f) => unsafe { f(self.ops.host_data, self.instance, contribution.as_ptr(), contribution.len()) },
            None => ffi::RPMI_ERR_INVALID,
        };
        if rc != ffi::RPMI_OK {
            self.post(Event::CollectiveDone(Err(format!("the resource manager could not start the exchange ({rc})"))));
        }
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        self.end_job(rank, exit_code, ffi::RPMI_ABORT_CALLED, message);
    }

    fn job_error(&mut self, error: &JobError) {
        let reason = match error {
            JobError::Protocol { .. } => ffi::RPMI_ABORT_PROTOCOL,
            JobError::TaskLost { .. } => ffi::RPMI_ABORT_TASK_LOST,
        };
        self.end_job(error.rank(), 1, reason, &error.to_string());
    }

    fn log(&mut self, level: log::Level, message: &str) {
        match self.ops.log {
            // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
            Some(f) if self.has(end_of!(log)) => {
                let text = nul_terminated(message);
                unsafe { f(self.ops.host_data, level as i32, text.as_ptr().cast(), message.len()) }
            }
            // The header's promise: without a log callback, messages go to stderr.
            _ => eprintln!("rpmi: {message}"),
        }
    }

    fn trace(&mut self, rank: u32, direction: Direction, line: &[u8]) {
        let text = format!("rank {rank} {direction}: {}", String::from_utf8_lossy(line));
        self.log(log::Level::Trace, &text);
    }

    fn request(&mut self, task: TaskId, request: HostRequest<'_>) -> Offered {
        let (data, inst, t) = (self.ops.host_data, self.instance, task as u32);
        // SAFETY (all four): C callbacks with the host's own data and NUL-terminated strings that live
        // through the call.
        match request {
            HostRequest::Publish { service, port } => match self.ops.publish.filter(|_| self.has(end_of!(publish))) {
                Some(f) => self.start(task, Service::Publish, || unsafe {
                    f(data, inst, t, c_string(service).as_ptr(), c_string(port).as_ptr())
                }),
                None => Offered::No,
            },
            HostRequest::Unpublish { service } => match self.ops.unpublish.filter(|_| self.has(end_of!(unpublish))) {
                Some(f) => {
                    self.start(task, Service::Unpublish, || unsafe { f(data, inst, t, c_string(service).as_ptr()) })
                }
                None => Offered::No,
            },
            HostRequest::Lookup { service } => match self.ops.lookup.filter(|_| self.has(end_of!(lookup))) {
                Some(f) => {
                    self.start(task, Service::Lookup, || unsafe { f(data, inst, t, c_string(service).as_ptr()) })
                }
                None => Offered::No,
            },
            HostRequest::Spawn(spawn) => match self.ops.spawn.filter(|_| self.has(end_of!(spawn))) {
                Some(f) => {
                    let json = spawn_json(spawn);
                    self.start(task, Service::Spawn, || unsafe { f(data, inst, t, json.as_ptr().cast(), json.len()) })
                }
                None => Offered::No,
            },
        }
    }
}

impl crate::node::NodeHost for CHost {}

impl CHost {
    fn end_job(&mut self, rank: u32, exit_code: i32, reason: i32, message: &str) {
        if let Some(f) = self.ops.abort {
            let text = nul_terminated(message);
            // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
            unsafe { f(self.ops.host_data, rank, exit_code, reason, text.as_ptr().cast(), message.len()) };
        } else {
            log::error!("{message} (the host gave no abort callback)");
        }
    }
}

/// The spawn request as the JSON object `rpmi_host_ops.spawn` documents.
pub fn spawn_json(spawn: &SpawnRequest) -> String {
    use serde_json::{json, Value};
    let text = |b: &[u8]| Value::String(String::from_utf8_lossy(b).into_owned());
    let pairs = |p: &[(Vec<u8>, Vec<u8>)]| Value::Array(p.iter().map(|(k, v)| json!([text(k), text(v)])).collect());
    let commands: Vec<Value> = spawn
        .commands
        .iter()
        .map(|c| {
            json!({
                "nprocs": c.nprocs,
                "execname": text(&c.execname),
                "args": c.args.iter().map(|a| text(a)).collect::<Vec<_>>(),
                "preputs": pairs(&c.preputs),
                "infos": pairs(&c.infos),
            })
        })
        .collect();
    json!({ "commands": commands }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::SpawnCommand;

    #[test]
    fn spawn_request_as_json() {
        let req = SpawnRequest {
            commands: vec![SpawnCommand {
                nprocs: 2,
                execname: b"./a".to_vec(),
                args: vec![b"-x".to_vec()],
                preputs: vec![(b"k".to_vec(), b"v".to_vec())],
                infos: vec![],
            }],
        };
        assert_eq!(
            spawn_json(&req),
            r#"{"commands":[{"args":["-x"],"execname":"./a","infos":[],"nprocs":2,"preputs":[["k","v"]]}]}"#
        );
    }

    #[test]
    fn untyped_answers_are_read_by_service() {
        assert_eq!(read_reply(Service::Lookup, true, Some("p".into())), HostReply::Port("p".into()));
        assert_eq!(read_reply(Service::Spawn, true, Some("0,-1".into())), HostReply::Spawned { errcodes: vec![0, -1] });
        assert!(matches!(read_reply(Service::Spawn, true, Some("x".into())), HostReply::Failed(_)));
        assert_eq!(
            read_reply(Service::Publish, false, None),
            HostReply::Failed("the resource manager failed it".into())
        );
    }
}
