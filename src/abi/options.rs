//! The plugin's options, given by the host as a JSON object (`rpmi_job_info.options_json`).

use crate::collective::{Allgather, DEFAULT_WIDTH};
use crate::server::Limits;
use serde_json::Value;

/// Options of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub limits: Limits,
    /// Send every PMI line through the host's log at trace level.
    pub trace: bool,
    /// Where the plugin runs the exchanges among the shells (`shell_send`): the tree's width, and how an
    /// exchange's parts reach every shell.
    pub tree_width: u32,
    pub allgather: Allgather,
}

impl Default for Options {
    fn default() -> Options {
        Options { limits: Limits::default(), trace: false, tree_width: DEFAULT_WIDTH, allgather: Allgather::Tree }
    }
}

/// The widest tree a job's shells may make: wider only makes shell 0 send more.
const TREE_WIDTH_MAX: u64 = 1024;

/// Every option, with what it sets; docs/man/rpmi-options.7.md lists the same.
const KNOWN: &[&str] = &[
    "kvsname_max",
    "keylen_max",
    "vallen_max",
    "request_line_max",
    "kvs_bytes_max",
    "spawn_bytes_max",
    "trace",
    "tree_width",
    "allgather",
];

impl Options {
    /// Parses `json` (None: all defaults). An unknown option, a wrong type or limits no client could use
    /// are errors whose text names the option.
    pub fn parse(json: Option<&str>) -> Result<Options, String> {
        let mut o = Options::default();
        let Some(json) = json.filter(|j| !j.trim().is_empty()) else {
            return Ok(o);
        };
        let value: Value = serde_json::from_str(json).map_err(|e| format!("options are not valid JSON: {e}"))?;
        let Value::Object(map) = value else {
            return Err("options must be a JSON object".into());
        };
        for (key, v) in &map {
            let number = || v.as_u64().ok_or_else(|| format!("option '{key}' must be a non-negative integer, not {v}"));
            let u32_of = |n: u64| u32::try_from(n).map_err(|_| format!("option '{key}' is too large: {n}"));
            let l = &mut o.limits;
            match key.as_str() {
                "kvsname_max" => l.kvsname_max = u32_of(number()?)?,
                "keylen_max" => l.keylen_max = u32_of(number()?)?,
                "vallen_max" => l.vallen_max = u32_of(number()?)?,
                "request_line_max" => l.request_line_max = number()? as usize,
                "kvs_bytes_max" => l.kvs_bytes_max = number()? as usize,
                "spawn_bytes_max" => l.spawn_bytes_max = number()? as usize,
                "trace" => {
                    o.trace = v.as_bool().ok_or_else(|| format!("option 'trace' must be true or false, not {v}"))?
                }
                "tree_width" => match number()? {
                    w @ 1..=TREE_WIDTH_MAX => o.tree_width = w as u32,
                    w => return Err(format!("option 'tree_width' must be 1 to {TREE_WIDTH_MAX}, not {w}")),
                },
                "allgather" => {
                    o.allgather = v
                        .as_str()
                        .and_then(Allgather::from_name)
                        .ok_or_else(|| format!("option 'allgather' must be \"tree\" or \"bruck\", not {v}"))?
                }
                _ => return Err(format!("unknown option '{key}' (known: {})", KNOWN.join(", "))),
            }
        }
        o.limits.validate().map_err(|e| format!("options: {e}"))?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(Options::parse(None), Ok(Options::default()));
        assert_eq!(Options::parse(Some(" ")), Ok(Options::default()));
        let o = Options::parse(Some(r#"{"vallen_max": 512, "trace": true}"#)).unwrap();
        assert_eq!(o.limits.vallen_max, 512);
        assert!(o.trace);
        let o = Options::parse(Some(r#"{"tree_width": 2, "allgather": "bruck"}"#)).unwrap();
        assert_eq!((o.tree_width, o.allgather), (2, Allgather::Bruck));
    }

    #[test]
    fn errors_name_the_option() {
        let e = Options::parse(Some(r#"{"vallen": 512}"#)).unwrap_err();
        assert!(e.starts_with("unknown option 'vallen' (known: kvsname_max"), "{e}");
        assert!(Options::parse(Some(r#"{"trace": 1}"#)).unwrap_err().contains("'trace'"));
        assert!(Options::parse(Some(r#"{"keylen_max": -1}"#)).unwrap_err().contains("'keylen_max'"));
        assert!(Options::parse(Some("[1]")).unwrap_err().contains("JSON object"));
        assert!(Options::parse(Some(r#"{"tree_width": 0}"#)).unwrap_err().contains("1 to 1024"));
        assert!(Options::parse(Some(r#"{"allgather": "ring"}"#)).unwrap_err().contains("\"bruck\""));
        assert!(Options::parse(Some("{")).unwrap_err().contains("not valid JSON"));
        assert!(Options::parse(Some(r#"{"kvsname_max": 512, "keylen_max": 256}"#)).unwrap_err().contains("MPICH"));
    }
}
