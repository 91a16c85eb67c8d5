//! A minimal PMI-1 wire client (Flux RFC 13): one request line out, one response line back.
//! Written from the protocol text rather than from any one server, and tolerant the way the RFC
//! asks (tuples in any order, extra keys, `rc` optional), so it can judge any PMI-1 server.

use std::io::{ErrorKind, Read, Write};

/// Longest response line we buffer; a server that never sends a newline must not eat all memory.
const MAX_LINE: usize = 1 << 20;

/// Longest piece of a response quoted in an error message.
const MAX_QUOTE: usize = 200;

/// One parsed response line.
#[derive(Debug)]
pub struct Response {
    line: String,
    cmd: String,
    rc: i64,
    pairs: Vec<(String, String)>,
}

impl Response {
    /// Splits a line into key=value tuples. `value=` runs to the end of the line, because values
    /// may contain spaces and `=`; every other tuple ends at whitespace.
    pub fn parse(line: &str) -> Result<Response, String> {
        let mut pairs = Vec::new();
        let mut rest = line.trim_start();
        while !rest.is_empty() {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            let (key, val) = rest[..end]
                .split_once('=')
                .filter(|(key, _)| !key.is_empty())
                .ok_or_else(|| format!("malformed response (`{}` is not key=value): {}", &rest[..end], quote(line)))?;
            if key == "value" {
                pairs.push((key.to_string(), rest[key.len() + 1..].to_string()));
                break;
            }
            pairs.push((key.to_string(), val.to_string()));
            rest = rest[end..].trim_start();
        }
        let find = |k: &str| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| v);
        let cmd = find("cmd").ok_or_else(|| format!("malformed response (no cmd=): {}", quote(line)))?.clone();
        let rc = match find("rc") {
            None => 0,
            Some(rc) => rc.parse().map_err(|_| format!("malformed response (rc={rc}): {}", quote(line)))?,
        };
        Ok(Response { line: line.to_string(), cmd, rc, pairs })
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// A field the reply must carry.
    fn field(&self, key: &str) -> Result<&str, String> {
        self.get(key)
            .ok_or_else(|| format!("malformed response (no {key}= in cmd={}): {}", self.cmd, quote(&self.line)))
    }

    /// An integer field the reply must carry.
    fn int(&self, key: &str) -> Result<i64, String> {
        let text = self.field(key)?;
        text.parse().map_err(|_| format!("malformed response ({key}={text} is not an integer): {}", quote(&self.line)))
    }
}

/// Keeps error lines readable when a response carries a long value.
fn quote(line: &str) -> String {
    match line.char_indices().nth(MAX_QUOTE) {
        Some((cut, _)) => format!("`{}...` ({} bytes)", &line[..cut], line.len()),
        None => format!("`{line}`"),
    }
}

/// Size limits the server advertises (`cmd=maxes`).
pub struct Maxes {
    pub kvsname: i64,
    pub key: i64,
    pub value: i64,
}

/// A PMI-1 connection. Generic over the stream so tests can script a server.
pub struct Client<S> {
    stream: S,
    /// Bytes read but not yet consumed: a read may end mid-line or carry more than one line.
    buf: Vec<u8>,
}

impl<S: Read + Write> Client<S> {
    pub fn new(stream: S) -> Client<S> {
        Client { stream, buf: Vec::new() }
    }

    /// Sends one request line and reads the reply, which must be `cmd=<expect>`.
    /// A non-zero rc is returned to the caller, not treated as an error here.
    fn call(&mut self, request: &str, expect: &str) -> Result<Response, String> {
        let what = request.split(' ').next().unwrap_or(request);
        let mut line = String::with_capacity(request.len() + 1);
        line.push_str(request);
        line.push('\n');
        self.stream.write_all(line.as_bytes()).map_err(|e| format!("sending {what} to the server: {e}"))?;
        let reply = self.read_line().map_err(|e| format!("waiting for the reply to {what}: {e}"))?;
        let resp = Response::parse(&reply)?;
        if resp.cmd != expect {
            return Err(format!("expected cmd={expect} in reply to {what}, got: {}", quote(&reply)));
        }
        Ok(resp)
    }

    /// Like `call`, for requests that must succeed.
    fn call_ok(&mut self, request: &str, expect: &str) -> Result<Response, String> {
        let resp = self.call(request, expect)?;
        if resp.rc != 0 {
            let what = request.split(' ').next().unwrap_or(request);
            return Err(format!("server failed {what} (rc={}): {}", resp.rc, quote(&resp.line)));
        }
        Ok(resp)
    }

    fn read_line(&mut self) -> Result<String, String> {
        let mut scanned = 0;
        loop {
            if let Some(at) = self.buf[scanned..].iter().position(|&b| b == b'\n') {
                let rest = self.buf.split_off(scanned + at + 1);
                let mut line = std::mem::replace(&mut self.buf, rest);
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return String::from_utf8(line).map_err(|e| format!("response is not UTF-8: {:?}", e.as_bytes()));
            }
            scanned = self.buf.len();
            if scanned > MAX_LINE {
                return Err(format!("response line longer than {MAX_LINE} bytes"));
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) if self.buf.is_empty() => return Err("server closed the connection".to_string()),
                Ok(0) => {
                    return Err(format!(
                        "server closed the connection after a partial line: {}",
                        quote(&String::from_utf8_lossy(&self.buf))
                    ))
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Negotiates PMI 1.1. The version fields are optional in the RFC, but if present they must
    /// say 1: anything else means the server is speaking a protocol we cannot follow.
    pub fn init(&mut self) -> Result<(), String> {
        let resp = self.call_ok("cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")?;
        if let Some(v) = resp.get("pmi_version") {
            if v != "1" {
                return Err(format!("server answered init with PMI version {v}, not 1: {}", quote(&resp.line)));
            }
        }
        Ok(())
    }

    pub fn maxes(&mut self) -> Result<Maxes, String> {
        let resp = self.call_ok("cmd=get_maxes", "maxes")?;
        Ok(Maxes { kvsname: resp.int("kvsname_max")?, key: resp.int("keylen_max")?, value: resp.int("vallen_max")? })
    }

    pub fn kvsname(&mut self) -> Result<String, String> {
        let resp = self.call_ok("cmd=get_my_kvsname", "my_kvsname")?;
        Ok(resp.field("kvsname")?.to_string())
    }

    /// Signed: Hydra answers -1 when no universe size was given.
    pub fn universe_size(&mut self) -> Result<i64, String> {
        self.call_ok("cmd=get_universe_size", "universe_size")?.int("size")
    }

    /// Signed: Slurm answers -1.
    pub fn appnum(&mut self) -> Result<i64, String> {
        self.call_ok("cmd=get_appnum", "appnum")?.int("appnum")
    }

    pub fn put(&mut self, kvsname: &str, key: &str, value: &str) -> Result<(), String> {
        self.call_ok(&format!("cmd=put kvsname={kvsname} key={key} value={value}"), "put_result").map(drop)
    }

    pub fn barrier(&mut self) -> Result<(), String> {
        self.call_ok("cmd=barrier_in", "barrier_out").map(drop)
    }

    /// `None` when the server answers rc != 0, which is how PMI-1 says "no such key".
    pub fn get(&mut self, kvsname: &str, key: &str) -> Result<Option<String>, String> {
        let resp = self.call(&format!("cmd=get kvsname={kvsname} key={key}"), "get_result")?;
        if resp.rc != 0 {
            return Ok(None);
        }
        Ok(Some(resp.field("value")?.to_string()))
    }

    /// Ends the session; the stream is closed when the client is dropped.
    pub fn finalize(mut self) -> Result<(), String> {
        self.call_ok("cmd=finalize", "finalize_ack").map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::{Client, Response};
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
    fn tuples_in_any_order_with_extra_keys() {
        let r = Response::parse("  rc=0 msg=success cmd=get_result  x=1 value=a b=c  ").unwrap();
        assert_eq!(r.cmd, "get_result");
        assert_eq!(r.rc, 0);
        assert_eq!(r.get("value"), Some("a b=c  "));
        assert_eq!(r.get("x"), Some("1"));
    }

    #[test]
    fn rc_absent_means_success() {
        let r = Response::parse("cmd=barrier_out").unwrap();
        assert_eq!(r.rc, 0);
        let r = Response::parse("cmd=get_result rc=-1 msg=key_missing_not_found").unwrap();
        assert_eq!(r.rc, -1);
    }

    #[test]
    fn empty_value_is_kept() {
        let r = Response::parse("cmd=get_result rc=0 value=").unwrap();
        assert_eq!(r.get("value"), Some(""));
    }

    #[test]
    fn malformed_responses() {
        for line in ["", "cmd", "rc=0", "cmd=put_result rc=x", "cmd=x =y", "cmd=x junk"] {
            assert!(Response::parse(line).is_err(), "accepted {line:?}");
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
        c.init().unwrap();
        assert_eq!(c.kvsname().unwrap(), "k1");
        c.barrier().unwrap();
        assert_eq!(
            String::from_utf8(c.stream.sent).unwrap(),
            "cmd=init pmi_version=1 pmi_subversion=1\ncmd=get_my_kvsname\ncmd=barrier_in\n"
        );
    }

    #[test]
    fn get_found_and_missing() {
        let mut c = Client::new(Script::new(&[
            "cmd=get_result rc=0 msg=success value=(vector,(0,1,1))\n",
            "cmd=get_result rc=-1 msg=key_missing_not_found value=unknown\n",
            "cmd=get_result rc=0\n",
        ]));
        assert_eq!(c.get("k", "PMI_process_mapping").unwrap().as_deref(), Some("(vector,(0,1,1))"));
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
        assert!(c.init().is_err());

        let mut c = Client::new(Script::new(&["cmd=maxes rc=0 kvsname_max=64 keylen_max=64\n"]));
        assert!(c.maxes().is_err());
    }
}
