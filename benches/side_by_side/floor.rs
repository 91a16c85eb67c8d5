//! The floor: the least a PMI-1 server can do. One thread, canned answers and no key-value store at all (a
//! get is answered with a value as long as the last put's, whatever the key). Not a PMI server anyone could
//! use: it shows how far each real server is from what this machine allows. It answers its tasks in the
//! order rpmi does ([`Turns`]), since that order is part of what the machine allows.

use rpmi::driver::Turns;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

const CANNED_VALUE: [u8; 1024] = [b'v'; 1024];

/// Runs `program args` as `size` tasks, serves them until every one has closed its connection, and
/// returns the worst exit status.
pub fn serve(size: usize, program: &str, args: &[String]) -> Result<i32, String> {
    let mut turns = Turns::new(size).map_err(|e| format!("epoll: {e}"))?;
    let mut conns = Vec::with_capacity(size);
    let mut children: Vec<Child> = Vec::with_capacity(size);
    for rank in 0..size {
        let (ours, theirs) = rpmi::driver::socketpair().map_err(|e| format!("socketpair for rank {rank}: {e}"))?;
        let fd = theirs.as_raw_fd();
        let mut command = Command::new(program);
        command.args(args).env("PMI_FD", fd.to_string()).env("PMI_RANK", rank.to_string());
        command.env("PMI_SIZE", size.to_string());
        // SAFETY: only fcntl, which is async-signal-safe, runs between fork and exec.
        unsafe {
            command.pre_exec(move || cvt(libc::fcntl(fd, libc::F_SETFD, 0)).map(drop));
        }
        children.push(command.spawn().map_err(|e| format!("cannot run {program}: {e}"))?);
        drop(theirs);
        turns.add(rank, ours.as_raw_fd(), libc::EPOLLIN as u32).map_err(|e| format!("epoll_ctl: {e}"))?;
        conns.push(Some(Conn { fd: ours, input: Vec::new() }));
    }
    Floor { conns, size, in_barrier: 0, value_len: 96, out: Vec::new() }.run(&mut turns)?;
    let mut worst = 0;
    for mut child in children {
        let status = child.wait().map_err(|e| format!("wait: {e}"))?;
        worst = worst.max(status.code().unwrap_or(128));
    }
    Ok(worst)
}

struct Conn {
    fd: OwnedFd,
    input: Vec<u8>,
}

struct Floor {
    conns: Vec<Option<Conn>>,
    size: usize,
    in_barrier: usize,
    value_len: usize,
    out: Vec<u8>,
}

impl Floor {
    fn run(&mut self, turns: &mut Turns) -> Result<(), String> {
        let mut open = self.size;
        let mut ready = [libc::epoll_event { events: 0, u64: 0 }; 256];
        let mut buf = vec![0u8; 65536];
        while open > 0 {
            let n = turns.wait(&mut ready, -1).map_err(|e| format!("epoll_wait: {e}"))?;
            for ev in &ready[..n] {
                let rank = ev.u64 as usize;
                let Some(conn) = &mut self.conns[rank] else { continue };
                // SAFETY: reading into our own buffer, its length passed.
                let got = unsafe { libc::recv(conn.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if got <= 0 {
                    self.conns[rank] = None;
                    open -= 1;
                    continue;
                }
                conn.input.extend_from_slice(&buf[..got as usize]);
                let mut input = std::mem::take(&mut conn.input);
                let mut start = 0;
                while let Some(len) = input[start..].iter().position(|&b| b == b'\n') {
                    self.answer(rank, &input[start..start + len])?;
                    start += len + 1;
                }
                input.drain(..start);
                if let Some(conn) = &mut self.conns[rank] {
                    conn.input = input;
                }
            }
        }
        Ok(())
    }

    fn answer(&mut self, rank: usize, line: &[u8]) -> Result<(), String> {
        let line = std::str::from_utf8(line).map_err(|_| format!("rank {rank} sent a line that is not text"))?;
        let command = line.split_whitespace().next().unwrap_or("");
        self.out.clear();
        match command {
            "cmd=init" => self.out.extend_from_slice(b"cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n"),
            "cmd=get_maxes" => {
                self.out.extend_from_slice(b"cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866\n")
            }
            "cmd=get_my_kvsname" => self.out.extend_from_slice(b"cmd=my_kvsname rc=0 kvsname=floor\n"),
            "cmd=get_universe_size" => {
                self.out.extend_from_slice(format!("cmd=universe_size rc=0 size={}\n", self.size).as_bytes())
            }
            "cmd=get_appnum" => self.out.extend_from_slice(b"cmd=appnum rc=0 appnum=0\n"),
            "cmd=put" => {
                let value = line.split_whitespace().find_map(|t| t.strip_prefix("value=")).unwrap_or("");
                self.value_len = value.len().clamp(1, CANNED_VALUE.len());
                self.out.extend_from_slice(b"cmd=put_result rc=0\n");
            }
            "cmd=get" => {
                self.out.extend_from_slice(b"cmd=get_result rc=0 value=");
                self.out.extend_from_slice(&CANNED_VALUE[..self.value_len]);
                self.out.push(b'\n');
            }
            "cmd=barrier_in" => {
                self.in_barrier += 1;
                if self.in_barrier == self.size {
                    self.in_barrier = 0;
                    for conn in &self.conns {
                        send(conn, b"cmd=barrier_out rc=0\n");
                    }
                }
                return Ok(());
            }
            "cmd=finalize" => self.out.extend_from_slice(b"cmd=finalize_ack rc=0\n"),
            _ => {
                return Err(format!(
                    "rank {rank}: the floor answers only what rpmi-probe sends, not `{}`",
                    line.trim_end()
                ))
            }
        }
        send(&self.conns[rank], &self.out);
        Ok(())
    }
}

/// Blocking write: a task reads its answer before it sends more, so the socket never stays full.
fn send(conn: &Option<Conn>, mut bytes: &[u8]) {
    let Some(conn) = conn else { return };
    while !bytes.is_empty() {
        // SAFETY: writing from a live slice, its length passed.
        let n = unsafe { libc::send(conn.fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
        match cvt(n) {
            Ok(n) => bytes = &bytes[n as usize..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return, // the task is gone; its EOF is seen next
        }
    }
}

fn cvt<T: Default + PartialOrd>(n: T) -> io::Result<T> {
    if n < T::default() {
        Err(io::Error::last_os_error())
    } else {
        Ok(n)
    }
}
