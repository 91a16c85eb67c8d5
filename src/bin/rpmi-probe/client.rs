//! A minimal PMI-1 wire client (Flux RFC 13): one request line out, one response line back.
//! Written from the protocol text rather than from any one server, and tolerant the way the RFC
//! asks (tuples in any order, extra keys, `rc` optional), so it can judge any PMI-1 server.

use rpmi::wire::reply::{quote, Reply};
use std::io::{ErrorKind, Read, Write};

/// Longest response line we buffer; a server that never sends a newline must not eat all memory.
const MAX_LINE: usize = 1 << 20;

/// Room for any line of a normal session: the read buffer grows only for a longer one.
const BUF: usize = 8192;

/// Size limits the server advertises (`cmd=maxes`).
pub struct Maxes {
    pub kvsname: i64,
    pub key: i64,
    pub value: i64,
}

/// A PMI-1 connection. Generic over the stream so tests can script a server.
pub struct Client<S> {
    stream: S,
    /// Read buffer, allocated once: `buf[start..end]` is what was read and not yet returned (a read may
    /// end mid-line or carry more than one line). Reads go straight into it, so a reply costs one read
    /// and no copy.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The request being sent, reused from one call to the next.
    out: Vec<u8>,
}

/// The command a request line names, for error messages.
fn command(request: &[u8]) -> String {
    let line = String::from_utf8_lossy(request);
    line.trim_end().split(' ').next().unwrap_or_default().to_string()
}

impl<S: Read + Write> Client<S> {
    pub fn new(stream: S) -> Client<S> {
        Client { stream, buf: vec![0; BUF], start: 0, end: 0, out: Vec::with_capacity(BUF) }
    }

    /// Sends one request line and reads the reply, which must be `cmd=<expect>`.
    /// A non-zero rc is returned to the caller, not treated as an error here.
    fn call(&mut self, request: std::fmt::Arguments, expect: &str) -> Result<Reply<'_>, String> {
        self.out.clear();
        // Writing into a Vec cannot fail.
        let _ = self.out.write_fmt(request);
        self.out.push(b'\n');
        if let Err(e) = self.stream.write_all(&self.out) {
            return Err(format!("sending {} to the server: {e}", command(&self.out)));
        }
        let line = match Self::read_line(&mut self.stream, &mut self.buf, &mut self.start, &mut self.end) {
            Ok(line) => line,
            Err(e) => return Err(format!("waiting for the reply to {}: {e}", command(&self.out))),
        };
        let resp = Reply::parse(line)?;
        if resp.cmd() != expect {
            return Err(format!("expected cmd={expect} in reply to {}, got: {}", command(&self.out), quote(line)));
        }
        Ok(resp)
    }

    /// Sends one request line without waiting for its reply (PMI 1.2's group barriers, which a threaded
    /// client has several of outstanding).
    pub fn send(&mut self, request: std::fmt::Arguments) -> Result<(), String> {
        self.out.clear();
        let _ = self.out.write_fmt(request);
        self.out.push(b'\n');
        self.stream.write_all(&self.out).map_err(|e| format!("sending {} to the server: {e}", command(&self.out)))
    }

    /// The next reply line, whatever it answers.
    pub fn reply(&mut self) -> Result<Reply<'_>, String> {
        let line = Self::read_line(&mut self.stream, &mut self.buf, &mut self.start, &mut self.end)?;
        Reply::parse(line)
    }

    /// Like `call`, for requests that must succeed.
    fn call_ok(&mut self, request: std::fmt::Arguments, expect: &str) -> Result<Reply<'_>, String> {
        let resp = self.call(request, expect)?;
        if resp.rc() != 0 {
            return Err(format!("server failed the request (rc={}): {}", resp.rc(), resp.quoted()));
        }
        Ok(resp)
    }

    /// The next line from `stream`, buffered in `buf[start..end]` (a function of the fields, not of `self`,
    /// so the line can be borrowed while the request is still quoted in an error).
    fn read_line<'b>(
        stream: &mut S,
        buf: &'b mut Vec<u8>,
        start: &mut usize,
        end: &mut usize,
    ) -> Result<&'b str, String> {
        if *start == *end {
            (*start, *end) = (0, 0);
        }
        let mut scanned = *start;
        loop {
            if let Some(at) = buf[scanned..*end].iter().position(|&b| b == b'\n') {
                let line = &buf[*start..scanned + at];
                *start = scanned + at + 1;
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                return std::str::from_utf8(line).map_err(|e| format!("response is not UTF-8: {e}"));
            }
            scanned = *end;
            if *end - *start > MAX_LINE {
                return Err(format!("response line longer than {MAX_LINE} bytes"));
            }
            if *end == buf.len() {
                // Full: move the partial line to the front, or grow for a line longer than the buffer.
                if *start > 0 {
                    buf.copy_within(*start..*end, 0);
                    (scanned, *end) = (*end - *start, *end - *start);
                    *start = 0;
                } else {
                    buf.resize(2 * buf.len(), 0);
                }
            }
            match stream.read(&mut buf[*end..]) {
                Ok(0) if *start == *end => return Err("server closed the connection".to_string()),
                Ok(0) => {
                    return Err(format!(
                        "server closed the connection after a partial line: {}",
                        quote(&String::from_utf8_lossy(&buf[*start..*end]))
                    ))
                }
                Ok(n) => *end += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Asks for PMI 1.`subversion` (1.2: group barriers) and says the subversion the server answered, which
    /// may be lower but never higher (RFC 13).
    pub fn init(&mut self, subversion: i64) -> Result<i64, String> {
        let init = format_args!("cmd=init pmi_version=1 pmi_subversion={subversion}");
        let resp = self.call_ok(init, "response_to_init")?;
        let answered = resp.get("pmi_subversion").and_then(|s| s.parse().ok()).unwrap_or(1);
        if resp.get("pmi_version").is_some_and(|v| v != "1") || answered > subversion {
            return Err(format!("server answered init with a version not asked for: {}", resp.quoted()));
        }
        Ok(answered)
    }

    pub fn maxes(&mut self) -> Result<Maxes, String> {
        let resp = self.call_ok(format_args!("cmd=get_maxes"), "maxes")?;
        Ok(Maxes { kvsname: resp.int("kvsname_max")?, key: resp.int("keylen_max")?, value: resp.int("vallen_max")? })
    }

    pub fn kvsname(&mut self) -> Result<String, String> {
        let resp = self.call_ok(format_args!("cmd=get_my_kvsname"), "my_kvsname")?;
        Ok(resp.field("kvsname")?.to_string())
    }

    /// Signed: Hydra answers -1 when no universe size was given.
    pub fn universe_size(&mut self) -> Result<i64, String> {
        self.call_ok(format_args!("cmd=get_universe_size"), "universe_size")?.int("size")
    }

    /// Signed: Slurm answers -1.
    pub fn appnum(&mut self) -> Result<i64, String> {
        self.call_ok(format_args!("cmd=get_appnum"), "appnum")?.int("appnum")
    }

    pub fn put(&mut self, kvsname: &str, key: &str, value: &str) -> Result<(), String> {
        self.call_ok(format_args!("cmd=put kvsname={kvsname} key={key} value={value}"), "put_result").map(drop)
    }

    pub fn barrier(&mut self) -> Result<(), String> {
        self.call_ok(format_args!("cmd=barrier_in"), "barrier_out").map(drop)
    }

    /// `None` when the server answers rc != 0, which is how PMI-1 says "no such key". The value is
    /// borrowed from the client's buffer until the next call.
    pub fn get(&mut self, kvsname: &str, key: &str) -> Result<Option<&str>, String> {
        let resp = self.call(format_args!("cmd=get kvsname={kvsname} key={key}"), "get_result")?;
        if resp.rc() != 0 {
            return Ok(None);
        }
        resp.field("value").map(Some)
    }

    /// Ends the session; the stream is closed when the client is dropped.
    pub fn finalize(mut self) -> Result<(), String> {
        self.call_ok(format_args!("cmd=finalize"), "finalize_ack").map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::Client;
    use std::io::{self, Read, Write};

    /// A scripted server: returns `chunks` one read at a time and records what was written.
    struct Script {
        chunks: Vec<Vec<u8>>,
        sent: Vec<u8>,
    }

    impl Script {
        fn new(chunks: &[&str]) -> Script {
            Script { chunks: chunks.iter().rev().map(|c| c.as_bytes().to_vec()).collect(), sent: Vec::new() }
        }
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let Some(mut chunk) = self.chunks.pop() else {
                return Ok(0);
            };
            let n = chunk.len().min(buf.len());
            buf[..n].copy_from_slice(&chunk[..n]);
            if n < chunk.len() {
                self.chunks.push(chunk.split_off(n));
            }
            Ok(n)
        }
    }

    impl Write for Script {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.sent.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_split_across_reads_and_merged_in_one_read() {
        let script = Script::new(&[
            "cmd=response_to_init rc=0 pmi_vers",
            "ion=1 pmi_subversion=1\r\ncmd=my_kvsname kvsname=k1\ncmd=barr",
            "i",
            "er_out\n",
        ]);
        let mut c = Client::new(script);
        assert_eq!(c.init(1), Ok(1));
        assert_eq!(c.kvsname().unwrap(), "k1");
        c.barrier().unwrap();
        assert_eq!(
            String::from_utf8(c.stream.sent).unwrap(),
            "cmd=init pmi_version=1 pmi_subversion=1\ncmd=get_my_kvsname\ncmd=barrier_in\n"
        );
    }

    #[test]
    fn a_line_across_the_end_of_the_buffer_and_a_line_longer_than_it() {
        let head = "cmd=barrier_out\ncmd=get_result rc=0 value=";
        // The first read fills the buffer exactly and ends mid-line.
        let first = format!("{head}{}", "x".repeat(super::BUF - head.len()));
        let long = "z".repeat(3 * super::BUF);
        let second = format!("yyy\ncmd=get_result rc=0 value={long}\n");
        let mut c = Client::new(Script::new(&[&first, &second]));
        c.barrier().unwrap();
        let value = c.get("k", "a").unwrap().unwrap().to_string();
        assert_eq!(value, format!("{}yyy", "x".repeat(super::BUF - head.len())));
        assert_eq!(c.get("k", "b").unwrap(), Some(long.as_str()));
    }

    #[test]
    fn get_found_and_missing() {
        let mut c = Client::new(Script::new(&[
            "cmd=get_result rc=0 msg=success value=(vector,(0,1,1))\n",
            "cmd=get_result rc=-1 msg=key_missing_not_found value=unknown\n",
            "cmd=get_result rc=0\n",
        ]));
        assert_eq!(c.get("k", "PMI_process_mapping").unwrap(), Some("(vector,(0,1,1))"));
        assert_eq!(c.get("k", "nope").unwrap(), None);
        assert!(c.get("k", "novalue").is_err());
    }

    #[test]
    fn errors() {
        let mut c = Client::new(Script::new(&["cmd=put_result rc=5 msg=too_long\n"]));
        let e = c.put("k", "key", "v").unwrap_err();
        assert!(e.contains("rc=5"), "{e}");

        let mut c = Client::new(Script::new(&["cmd=barrier_out\n"]));
        let e = c.put("k", "key", "v").unwrap_err();
        assert!(e.contains("expected cmd=put_result"), "{e}");

        let mut c = Client::new(Script::new(&["cmd=barrier_o"]));
        let e = c.barrier().unwrap_err();
        assert!(e.contains("partial line"), "{e}");

        let mut c = Client::new(Script::new(&[]));
        let e = c.barrier().unwrap_err();
        assert!(e.contains("server closed the connection"), "{e}");

        let mut c = Client::new(Script::new(&["cmd=response_to_init rc=0 pmi_version=2\n"]));
        assert!(c.init(1).is_err());

        // Above what was asked for is an error; below is what the probe then speaks.
        let mut c = Client::new(Script::new(&["cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=2\n"]));
        assert!(c.init(1).unwrap_err().contains("not asked for"));
        let mut c = Client::new(Script::new(&["cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1\n"]));
        assert_eq!(c.init(2), Ok(1));

        let mut c = Client::new(Script::new(&["cmd=maxes rc=0 kvsname_max=64 keylen_max=64\n"]));
        assert!(c.maxes().is_err());
    }
}
