//! The documentation against the tree and the code.
//!
//! - Every relative link in the project's Markdown (README.md, CHANGELOG.md, docs/**, plugin-spec/README.md,
//!   benches/results/README.md, fuzz/README.md) names a file or directory that exists, and its `#anchor`, if
//!   any, a heading of that file, slugged as GitHub does.
//! - `rpmi-run --help` and `rpmi-probe --help` list exactly the options the OPTIONS sections of their manual
//!   pages (docs/man/*.1.md) list.
//! - docs/man/rpmi-options.7.md has an entry for every option of the Slurm plugin (its mpi.conf key beside its
//!   variable, saying `default N`, `from A to B` and `Ceiling, built in C` or `Free` as src/slurm/options.rs
//!   has it), every option of the plugin ABI (src/abi/options.rs, saying the `default N` of
//!   crates/core/src/server/limits.rs or of `Options`' own defaults), srun's launch variables and the variables
//!   every task gets.
//!
//! Each test gathers every fault before it fails, each naming the file (and line) at fault. Only std: the
//! Markdown is read as far as these checks need (fenced code and code spans skipped), the Rust as far as the
//! option tables are written.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let path = root().join(rel);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Fails with every fault, one a line.
fn report(what: &str, faults: &[String]) {
    assert!(faults.is_empty(), "{} {what}:\n{}", faults.len(), faults.join("\n"));
}

// ---------------------------------------------------------------------------------------------------------
// Markdown, as far as the checks need it.

/// The lines of `text` outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<(char, usize)> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let run = |c: char| trimmed.chars().take_while(|&x| x == c).count();
        match fence {
            Some((c, n)) => {
                if indent < 4 && run(c) >= n && trimmed.trim_start_matches(c).trim().is_empty() {
                    fence = None;
                }
            }
            None => {
                let opened = ['`', '~'].into_iter().find(|&c| indent < 4 && run(c) >= 3);
                match opened {
                    Some(c) => fence = Some((c, run(c))),
                    None => out.push((i + 1, line)),
                }
            }
        }
    }
    out
}

/// `line` with its code spans blanked out (same length, so positions hold).
fn without_code_spans(line: &str) -> String {
    let bytes = line.as_bytes();
    let mut out = line.as_bytes().to_vec();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let n = bytes[i..].iter().take_while(|&&b| b == b'`').count();
        let ticks = &line[i..i + n];
        match line[i + n..].find(ticks) {
            Some(end) => {
                let stop = i + n + end + n;
                out[i..stop].fill(b' ');
                i = stop;
            }
            None => i += n,
        }
    }
    String::from_utf8(out).unwrap_or_default()
}

/// The link targets of one line of prose: inline links and images (`](target)`) and reference definitions
/// (`[label]: target`).
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') && line.len() - trimmed.len() < 4 {
        if let Some(end) = trimmed.find("]:") {
            if let Some(target) = trimmed[end + 2..].split_whitespace().next() {
                targets.push(target.trim_start_matches('<').trim_end_matches('>').to_string());
            }
        }
    }
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        // Up to the closing parenthesis, allowing balanced ones inside.
        let mut depth = 0;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = i;
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let inner = after[..end].trim();
        let target = match inner.strip_prefix('<') {
            Some(angled) => angled.split('>').next().unwrap_or_default(),
            // A title may follow the target: `(file.md "title")`.
            None => inner.split_whitespace().next().unwrap_or_default(),
        };
        if !target.is_empty() {
            targets.push(target.to_string());
        }
        rest = &after[end.min(after.len())..];
    }
    targets
}

/// The anchors of a Markdown file's headings, as GitHub makes them (github-slugger): the heading's text,
/// lowercased, without punctuation and symbols but `-` and `_`, each space a `-`; a repeated slug gets `-1`,
/// `-2`, ... Also the `id`s and `name`s of HTML anchors written in the file.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    let lines = prose_lines(text);
    for (k, &(number, line)) in lines.iter().enumerate() {
        let heading = atx_heading(line).or_else(|| {
            // A setext heading: a line of text under which a line of only `=` or `-` follows.
            let (next_number, next) = *lines.get(k + 1)?;
            let under = next.trim();
            let setext = next_number == number + 1
                && !under.is_empty()
                && (under.chars().all(|c| c == '=') || under.chars().all(|c| c == '-'))
                && !line.trim().is_empty()
                && !line.trim_start().starts_with(['-', '*', '+', '|', '>', '#'])
                && line.len() - line.trim_start().len() < 4;
            setext.then(|| line.trim().to_string())
        });
        if let Some(text) = heading {
            let base = slug(&text);
            let n = seen.entry(base.clone()).or_insert(0);
            out.insert(if *n == 0 { base.clone() } else { format!("{base}-{n}") });
            *n += 1;
        }
        for attr in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(at) = rest.find(attr) {
                let value = &rest[at + attr.len()..];
                let end = value.find('"').unwrap_or(value.len());
                if rest[..at].contains('<') {
                    out.insert(value[..end].to_string());
                }
                rest = &value[end..];
            }
        }
    }
    out
}

/// The text of an ATX heading (`## Text ##`), if `line` is one.
fn atx_heading(line: &str) -> Option<String> {
    let trimmed = line.trim_start();
    if line.len() - trimmed.len() >= 4 {
        return None;
    }
    let level = trimmed.chars().take_while(|&c| c == '#').count();
    if !(1..=6).contains(&level) {
        return None;
    }
    let rest = &trimmed[level..];
    if !rest.is_empty() && !rest.starts_with([' ', '\t']) {
        return None;
    }
    let text = rest.trim();
    // A closing run of `#`, if a space stands before it.
    let closed = text.trim_end_matches('#');
    let text = if closed.is_empty() || closed.ends_with([' ', '\t']) { closed.trim_end() } else { text };
    Some(text.to_string())
}

/// The heading's text as GitHub renders it (links by their text, no code marks or HTML tags), slugged.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](target)` and `![alt](target)` become their text.
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|c| open + c) else { break };
        let Some(end) = rest[close..].find(')').map(|e| close + e) else { break };
        text.push_str(rest[..open].trim_end_matches('!'));
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    let mut plain = String::new();
    let mut in_tag = false;
    for c in text.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => plain.push(c),
            _ => {}
        }
    }
    plain
        .trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == ' ' || c == '-' || c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// `%XX` escapes in a link's path.
fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The Markdown files whose links are checked, relative to the root.
fn markdown_files() -> Vec<String> {
    let mut files: Vec<String> =
        ["README.md", "CHANGELOG.md", "plugin-spec/README.md", "benches/results/README.md", "fuzz/README.md"]
            .map(String::from)
            .to_vec();
    let mut found: Vec<String> = files_under("docs", "md")
        .iter()
        .map(|path| path.strip_prefix(root()).unwrap_or(path).to_string_lossy().into_owned())
        .collect();
    found.sort();
    files.extend(found);
    files
}

/// Every file below `dir` (relative to the root) whose name ends in `.ext`.
fn files_under(dir: &str, ext: &str) -> Vec<PathBuf> {
    let (mut dirs, mut found) = (vec![root().join(dir)], Vec::new());
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == ext) {
                found.push(path);
            }
        }
    }
    found
}

/// `dir/target`, with `.` and `..` resolved within the tree (`None` if it climbs out of it).
fn resolve(dir: &Path, target: &str) -> Option<PathBuf> {
    let mut parts: Vec<Component> = Vec::new();
    let joined =
        if let Some(from_root) = target.strip_prefix('/') { PathBuf::from(from_root) } else { dir.join(target) };
    for c in joined.components() {
        match c {
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::CurDir => {}
            c => parts.push(c),
        }
    }
    Some(parts.iter().collect())
}

#[test]
fn every_relative_link_resolves() {
    let mut faults = Vec::new();
    let mut anchor_cache: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    for file in markdown_files() {
        let Ok(text) = fs::read_to_string(root().join(&file)) else {
            faults.push(format!("{file}: no such file (its links are to be checked)"));
            continue;
        };
        let dir = Path::new(&file).parent().unwrap_or(Path::new("")).to_path_buf();
        for (number, line) in prose_lines(&text) {
            for target in link_targets(line) {
                // Absolute URLs (any scheme) are not this tree's.
                let scheme = target.split_once(':').is_some_and(|(s, _)| {
                    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
                });
                if scheme || target.starts_with("//") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let path = percent_decoded(path);
                let where_ = format!("{file}:{number}: link `{target}`");
                let resolved = if path.is_empty() {
                    Some(PathBuf::from(&file))
                } else {
                    match resolve(&dir, &path) {
                        Some(p) => Some(p),
                        None => {
                            faults.push(format!("{where_}: leaves the repository"));
                            None
                        }
                    }
                };
                let Some(resolved) = resolved else { continue };
                let full = root().join(&resolved);
                if !full.exists() {
                    faults.push(format!("{where_}: no file {}", resolved.display()));
                    continue;
                }
                let Some(anchor) = anchor.filter(|a| !a.is_empty()) else { continue };
                if full.is_dir() || full.extension().is_none_or(|e| e != "md") {
                    faults.push(format!("{where_}: an anchor into {}, which is no Markdown file", resolved.display()));
                    continue;
                }
                let known = anchor_cache
                    .entry(resolved.clone())
                    .or_insert_with(|| anchors(&fs::read_to_string(&full).unwrap_or_default()));
                let anchor = percent_decoded(anchor);
                if !known.contains(&anchor) {
                    let near: Vec<&String> =
                        known.iter().filter(|k| k.contains(&anchor) || anchor.contains(k.as_str())).take(3).collect();
                    let hint = if near.is_empty() { String::new() } else { format!(" (near: {near:?})") };
                    faults.push(format!("{where_}: {} has no heading #{anchor}{hint}", resolved.display()));
                }
            }
        }
    }
    report("broken links", &faults);
}

// ---------------------------------------------------------------------------------------------------------
// --help against the manual pages.

/// Whether `token` is an option's name: `-x` or `--long-name`.
fn is_option(token: &str) -> bool {
    let name = token.strip_prefix("--").or_else(|| token.strip_prefix('-')).unwrap_or("");
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic()) && chars.all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// The options `--help` lists: on each line that starts (after its indent) with `-`, the names before the
/// description (which is two spaces or more away).
fn help_options(help: &str) -> BTreeSet<String> {
    let mut options = BTreeSet::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        if !trimmed.starts_with('-') {
            continue;
        }
        let names = trimmed.split("  ").next().unwrap_or_default();
        options.extend(names.split([',', ' ']).filter(|t| is_option(t)).map(String::from));
    }
    options
}

/// The lines of the section `# NAME` of a page, with their numbers.
fn section<'a>(page: &'a str, name: &str) -> Vec<(usize, &'a str)> {
    let mut inside = false;
    let mut out = Vec::new();
    for (number, line) in prose_lines(page) {
        if let Some(heading) = line.strip_prefix("# ") {
            inside = heading.trim() == name;
            continue;
        }
        if inside {
            out.push((number, line));
        }
    }
    out
}

/// The options a manual page's OPTIONS section documents: the code spans that are option names on each
/// definition's term (a line followed by one that starts with `:`).
fn page_options(page: &str) -> BTreeSet<String> {
    let lines = section(page, "OPTIONS");
    let mut options = BTreeSet::new();
    for pair in lines.windows(2) {
        let ((_, term), (_, next)) = (pair[0], pair[1]);
        if !next.starts_with(':') {
            continue;
        }
        options.extend(code_spans(term).into_iter().filter(|t| is_option(t)));
    }
    options
}

/// The contents of a line's code spans.
fn code_spans(line: &str) -> Vec<String> {
    let mut spans = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let n = rest[start..].chars().take_while(|&c| c == '`').count();
        let ticks = &rest[start..start + n];
        let after = &rest[start + n..];
        let Some(end) = after.find(ticks) else { break };
        spans.push(after[..end].trim().to_string());
        rest = &after[end + n..];
    }
    spans
}

#[test]
fn help_lists_the_options_the_manual_pages_do() {
    let mut faults = Vec::new();
    for (program, exe) in
        [("rpmi-run", env!("CARGO_BIN_EXE_rpmi-run")), ("rpmi-probe", env!("CARGO_BIN_EXE_rpmi-probe"))]
    {
        let page_file = format!("docs/man/{program}.1.md");
        let out = Command::new(exe).arg("--help").output().unwrap_or_else(|e| panic!("cannot run {exe}: {e}"));
        let help = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !help.starts_with("usage: ") {
            faults.push(format!("{program} --help: exit {:?}, output does not start with its usage line", out.status));
        }
        let from_help = help_options(&help);
        let Ok(page) = fs::read_to_string(root().join(&page_file)) else {
            faults.push(format!("{page_file}: no such file"));
            continue;
        };
        let from_page = page_options(&page);
        if from_page.is_empty() {
            faults.push(format!("{page_file}: no options in an OPTIONS section"));
        }
        for o in from_help.difference(&from_page) {
            faults.push(format!("{page_file}: OPTIONS lacks {o}, which `{program} --help` lists"));
        }
        for o in from_page.difference(&from_help) {
            faults.push(format!("{page_file}: OPTIONS has {o}, which `{program} --help` does not list"));
        }
    }
    report("differences between --help and the manual pages", &faults);
}

// ---------------------------------------------------------------------------------------------------------
// The options' page against the code.

/// The Rust constants of the library's sources (its own and rpmi-core's): name to its expression's text.
fn constants() -> HashMap<String, String> {
    let mut out = HashMap::new();
    for path in files_under("src", "rs").into_iter().chain(files_under("crates/core/src", "rs")) {
        let text = fs::read_to_string(&path).unwrap_or_default();
        for statement in text.split(';') {
            let Some(at) = statement.find("const ") else { continue };
            let decl = &statement[at + "const ".len()..];
            let Some((name, rest)) = decl.split_once(':') else { continue };
            let Some((_, value)) = rest.split_once('=') else { continue };
            let name = name.trim();
            if name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') {
                out.entry(name.to_string()).or_insert_with(|| value.trim().to_string());
            }
        }
    }
    out
}

/// Evaluates an integer expression of the option tables: literals, constants (`u32::MAX` and the sources'
/// own), `<<`, `*`, `+`, `-`, parentheses and `as` casts.
fn eval(expr: &str, consts: &HashMap<String, String>) -> Result<u128, String> {
    eval_at(expr, consts, 0)
}

/// [`eval`] of a constant's expression `depth` constants deep.
fn eval_at(expr: &str, consts: &HashMap<String, String>, depth: usize) -> Result<u128, String> {
    if depth > 8 {
        return Err(format!("`{expr}`: constants nested too deep"));
    }
    let mut tokens = Vec::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                i += 1;
            }
            tokens.push(chars[start..i].iter().collect::<String>());
        } else if c == '<' && chars.get(i + 1) == Some(&'<') {
            tokens.push("<<".into());
            i += 2;
        } else {
            tokens.push(c.to_string());
            i += 1;
        }
    }
    // `as TYPE` is no arithmetic.
    let mut plain = Vec::new();
    let mut it = tokens.into_iter();
    while let Some(t) = it.next() {
        if t == "as" {
            it.next();
        } else {
            plain.push(t);
        }
    }
    let mut parser = Parser { tokens: plain, at: 0, consts, depth };
    let value = parser.shift()?;
    match parser.tokens.get(parser.at) {
        None => Ok(value),
        Some(t) => Err(format!("`{expr}`: unexpected `{t}`")),
    }
}

struct Parser<'a> {
    tokens: Vec<String>,
    at: usize,
    consts: &'a HashMap<String, String>,
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.at).map(String::as_str)
    }

    fn shift(&mut self) -> Result<u128, String> {
        let mut v = self.sum()?;
        while self.peek() == Some("<<") {
            self.at += 1;
            v <<= self.sum()?;
        }
        Ok(v)
    }

    fn sum(&mut self) -> Result<u128, String> {
        let mut v = self.product()?;
        loop {
            match self.peek() {
                Some("+") => {
                    self.at += 1;
                    v += self.product()?;
                }
                Some("-") => {
                    self.at += 1;
                    v = v.checked_sub(self.product()?).ok_or("a negative value")?;
                }
                _ => return Ok(v),
            }
        }
    }

    fn product(&mut self) -> Result<u128, String> {
        let mut v = self.atom()?;
        while self.peek() == Some("*") {
            self.at += 1;
            v *= self.atom()?;
        }
        Ok(v)
    }

    fn atom(&mut self) -> Result<u128, String> {
        let token = self.peek().ok_or("an expression ends too soon")?.to_string();
        self.at += 1;
        if token == "(" {
            let v = self.shift()?;
            if self.peek() != Some(")") {
                return Err("an unclosed parenthesis".into());
            }
            self.at += 1;
            return Ok(v);
        }
        if let Ok(v) = token.replace('_', "").parse::<u128>() {
            return Ok(v);
        }
        match token.as_str() {
            "u16::MAX" => return Ok(u16::MAX.into()),
            "u32::MAX" => return Ok(u32::MAX.into()),
            "u64::MAX" => return Ok(u64::MAX.into()),
            _ => {}
        }
        let name = token.rsplit("::").next().unwrap_or_default();
        let expr = self.consts.get(name).ok_or_else(|| format!("no constant {token} in src/ or crates/core/src/"))?;
        eval_at(expr, self.consts, self.depth + 1)
    }
}

/// One option of src/slurm/options.rs's table.
struct SlurmOption {
    key: String,
    var: String,
    switch: bool,
    /// Its values are names (the allgather's), by number.
    names: Option<Vec<String>>,
    range: (u128, u128),
    default: u128,
    ceiling: Option<u128>,
}

/// The allgathers' names, in the order of their numbers (`Allgather::name` in the collective's module).
fn allgather_names() -> Vec<String> {
    let text = read("crates/core/src/collective/mod.rs");
    let body = text.split("pub fn name(self)").nth(1).and_then(|b| b.split("}\n").next()).unwrap_or_default();
    body.lines().filter(|l| l.contains("Allgather::")).filter_map(|l| Some(l.split('"').nth(1)?.to_string())).collect()
}

/// The value of field `name` in one `Opt { ... }` of the table, as written.
fn field<'a>(opt: &'a str, name: &str) -> Option<&'a str> {
    let at = opt.find(&format!("{name}:"))?;
    let rest = &opt[at + name.len() + 1..];
    // Up to the next `,` outside parentheses.
    let mut depth = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth > 0 => depth -= 1,
            ',' | '}' if depth == 0 => return Some(rest[..i].trim()),
            _ => {}
        }
    }
    Some(rest.trim())
}

fn slurm_options(consts: &HashMap<String, String>) -> Result<Vec<SlurmOption>, String> {
    let text = read("src/slurm/options.rs");
    let table = text.split("pub const OPTIONS").nth(1).ok_or("src/slurm/options.rs: no OPTIONS table")?;
    let table = table.split("];").next().unwrap_or_default();
    let mut out = Vec::new();
    for opt in table.split("Opt {").skip(1) {
        let get = |name: &str| field(opt, name).ok_or_else(|| format!("src/slurm/options.rs: an Opt without {name}"));
        let quoted = |s: &str| s.trim_start_matches('c').trim_matches('"').to_string();
        let value = |s: &str| eval(s, consts).map_err(|e| format!("src/slurm/options.rs: {e}"));
        let (start, end) = get("range")?.split_once("..=").ok_or("src/slurm/options.rs: a range not a..=b")?;
        let ceiling = get("ceiling")?;
        out.push(SlurmOption {
            key: quoted(get("key")?),
            var: quoted(get("var")?),
            switch: get("what")? == "SWITCH",
            names: (get("what")? == "ALLGATHER").then(allgather_names),
            range: (value(start)?, value(end)?),
            default: value(get("default")?)?,
            ceiling: match ceiling.strip_prefix("Some(").and_then(|c| c.strip_suffix(')')) {
                Some(c) => Some(value(c)?),
                None => None,
            },
        });
    }
    if out.is_empty() {
        return Err("src/slurm/options.rs: no Opt in the OPTIONS table".into());
    }
    Ok(out)
}

/// The entries of a definition list page: each term line (a line followed by one starting with `:`) with
/// its line number, and the text of the entry (its term and its definition, up to the next term or heading).
fn entries(page: &str) -> Vec<(usize, String, String)> {
    let lines = prose_lines(page);
    let mut out: Vec<(usize, String, String)> = Vec::new();
    for (k, &(number, line)) in lines.iter().enumerate() {
        let is_term = lines.get(k + 1).is_some_and(|&(_, next)| next.starts_with(':')) && !line.starts_with(':');
        if is_term {
            out.push((number, line.to_string(), line.to_string()));
        } else if line.starts_with('#') {
            out.push((number, String::new(), String::new()));
        } else if let Some(last) = out.last_mut() {
            last.2.push('\n');
            last.2.push_str(line);
        }
    }
    out.retain(|(_, term, _)| !term.is_empty());
    out
}

/// Whether `text` says `words` (`default 64`, `from 1 to 4096`), each number whole (not the start of a longer
/// one), the words split over lines or not.
fn says(text: &str, words: &str) -> bool {
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    text.match_indices(words).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + words.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_alphanumeric()) && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

/// The entry whose term names `name` as a code span, if any.
fn entry_for<'a>(entries: &'a [(usize, String, String)], name: &str) -> Option<&'a (usize, String, String)> {
    entries.iter().find(|(_, term, _)| code_spans(term).iter().any(|s| s == name))
}

#[test]
fn every_option_is_in_the_options_page_with_its_default() {
    const PAGE: &str = "docs/man/rpmi-options.7.md";
    let Ok(page) = fs::read_to_string(root().join(PAGE)) else { panic!("{PAGE}: no such file") };
    let entries = entries(&page);
    let consts = constants();
    let mut faults = Vec::new();

    // The Slurm plugin's options: key and variable in one entry, with the default, the range and the
    // built-in ceiling.
    match slurm_options(&consts) {
        Err(e) => faults.push(e),
        Ok(options) => {
            for o in options {
                let Some((number, term, text)) = entry_for(&entries, &o.key) else {
                    faults.push(format!("{PAGE}: no entry for mpi.conf's {} (src/slurm/options.rs)", o.key));
                    continue;
                };
                let at = format!("{PAGE}:{number}: the entry of {}", o.key);
                if !code_spans(term).contains(&o.var) {
                    faults.push(format!("{at} does not name its variable {} beside it", o.var));
                }
                let default = match (o.switch, o.default, &o.names) {
                    (_, d, Some(names)) => format!("default `{}`", names.get(d as usize).map_or("?", String::as_str)),
                    (true, 0, _) => "default no".to_string(),
                    (true, _, _) => "default yes".to_string(),
                    (false, d, _) => format!("default {d}"),
                };
                if !says(text, &default) {
                    faults.push(format!("{at} does not say `{default}`"));
                }
                let range = match &o.names {
                    Some(names) => names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" or "),
                    None => format!("from {} to {}", o.range.0, o.range.1),
                };
                if !o.switch && !says(text, &range) {
                    faults.push(format!("{at} does not say `{range}`"));
                }
                match o.ceiling {
                    Some(c) if !says(text, &format!("Ceiling, built in {c}")) => {
                        faults.push(format!("{at} does not say `Ceiling, built in {c}`"))
                    }
                    None if !says(text, "Free") => faults.push(format!("{at} does not say it is `Free`")),
                    _ => {}
                }
            }
        }
    }

    // srun's launch variables: every one the plugin sets.
    let slurm = read("src/slurm/options.rs");
    for line in slurm.lines().filter(|l| l.starts_with("pub const ENV_")) {
        let Some(var) = line.split('"').nth(1) else { continue };
        if entry_for(&entries, var).is_none() {
            faults.push(format!("{PAGE}: no entry for srun's launch variable {var} (src/slurm/options.rs)"));
        }
    }

    // The plugin ABI's options, with the defaults of `Limits`, or of `Options` for the others (an integer, a
    // boolean, or an allgather by its name).
    let abi = read("src/abi/options.rs");
    let own = abi.split("impl Default for Options").nth(1).unwrap_or_default();
    let known = abi.split("const KNOWN").nth(1).and_then(|k| k.split(';').next()).unwrap_or_default();
    let keys: Vec<&str> = known.split('"').skip(1).step_by(2).collect();
    if keys.is_empty() {
        faults.push("src/abi/options.rs: no KNOWN keys".into());
    }
    let limits = read("crates/core/src/server/limits.rs");
    let defaults = limits.split("impl Default for Limits").nth(1).unwrap_or_default();
    for key in keys {
        let default = match field(defaults, key) {
            Some(expr) => match eval(expr, &consts) {
                Ok(v) => v.to_string(),
                Err(e) => {
                    faults.push(format!("crates/core/src/server/limits.rs: {key}'s default: {e}"));
                    continue;
                }
            },
            // Not a limit: a field of `Options`.
            None => match field(own, key).map(|e| e.trim().trim_end_matches('}').trim()) {
                Some(b @ ("true" | "false")) => b.into(),
                Some(a) if a.starts_with("Allgather::") => format!("\"{}\"", a["Allgather::".len()..].to_lowercase()),
                Some(expr) => match eval(expr, &consts) {
                    Ok(v) => v.to_string(),
                    Err(e) => {
                        faults.push(format!("src/abi/options.rs: {key}'s default: {e}"));
                        continue;
                    }
                },
                None => {
                    faults.push(format!("src/abi/options.rs: no default found for the option {key}"));
                    continue;
                }
            },
        };
        let Some((number, _, text)) = entry_for(&entries, key) else {
            faults.push(format!("{PAGE}: no entry for the plugin option {key} (src/abi/options.rs)"));
            continue;
        };
        if !says(text, &format!("default {default}")) {
            faults.push(format!("{PAGE}:{number}: the entry of {key} does not say `default {default}`"));
        }
    }

    // The variables every task gets (src/runtime/).
    let node = read("src/runtime/mod.rs");
    let vars: BTreeSet<&str> =
        node.split("EnvVar::new(\"").skip(1).filter_map(|piece| piece.split('"').next()).collect();
    if vars.is_empty() {
        faults.push("src/runtime/mod.rs: no EnvVar::new(\"...\") found".into());
    }
    for var in vars {
        if entry_for(&entries, var).is_none() {
            faults.push(format!("{PAGE}: no entry for the task variable {var} (src/runtime/mod.rs)"));
        }
    }
    report("faults in the options' manual page", &faults);
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn slugs_as_github_makes_them() {
        assert_eq!(slug("10 Options"), "10-options");
        assert_eq!(slug("Slurm: `srun --mpi=rpmi`"), "slurm-srun---mpirpmi");
        assert_eq!(slug("Spawn, names and MPMD"), "spawn-names-and-mpmd");
        assert_eq!(slug("(a) all-to-all: 1 put of 96 chars"), "a-all-to-all-1-put-of-96-chars");
        assert_eq!(slug("The [ABI](plugin-spec/README.md) and kvs_bytes_max"), "the-abi-and-kvs_bytes_max");
        let text = "# Options\n\n## Options\n\n```\n# not a heading\n```\n\nTitle\n-----\n";
        let found = anchors(text);
        assert!(found.contains("options") && found.contains("options-1") && found.contains("title"), "{found:?}");
        assert!(!found.contains("not-a-heading"), "{found:?}");
    }

    #[test]
    fn links_are_found_outside_code() {
        let line = "see [a](docs/a.md#x), `[b](no.md)` and ![c](img.png \"title\"), [d]: <e.md>";
        assert_eq!(link_targets(line), ["docs/a.md#x", "img.png"]);
        assert_eq!(link_targets("[label]: ../x.md#y"), ["../x.md#y"]);
    }

    #[test]
    fn expressions_of_the_option_tables() {
        let consts = HashMap::from([("LIMIT".to_string(), "(u32::MAX as u64) - (1 << 20)".to_string())]);
        assert_eq!(eval("512 << 20", &consts), Ok(536870912));
        assert_eq!(eval("super::x::LIMIT", &consts), Ok(4293918719));
        assert_eq!(eval("256 * 1024", &consts), Ok(262144));
        assert!(eval("NOWHERE", &consts).is_err());
    }

    #[test]
    fn options_from_help_and_from_pages() {
        let help = "usage: x [-n N]\n\noptions:\n  -n, --ntasks N   run N\n  --trace          trace\n  : -n N P  more";
        assert_eq!(help_options(help), BTreeSet::from(["-n".into(), "--ntasks".into(), "--trace".into()]));
        let page = "# OPTIONS\n\n`-n` *N*, `--ntasks` *N*  \n:   Run, see `--other`.\n\n# MORE\n\n`-x`\n:   no\n";
        assert_eq!(page_options(page), BTreeSet::from(["-n".into(), "--ntasks".into()]));
    }
}

/// What a site admin reads before production is reached from the README's map, in the admin's own row:
/// where the plugin must be installed, what `MpiDefault=rpmi` means, the way back to pmi2, what one job can
/// make a node hold, and what to do when a job hangs at start-up (that each anchor is a heading of its page
/// is `every_relative_link_resolves`'s to check).
#[test]
fn the_admins_path_is_linked_from_the_readmes_map() {
    let readme = read("README.md");
    let row = readme
        .lines()
        .find(|l| l.starts_with("| Slurm site admin |"))
        .expect("README.md's map has no Slurm site admin row");
    let missing: Vec<String> = [
        "docs/slurm.md#installing-on-every-node",
        "docs/slurm.md#mpidefaultrpmi",
        "docs/slurm.md#the-way-back-to-pmi2",
        "docs/slurm.md#what-one-job-can-make-a-node-hold",
        "docs/troubleshooting.md#the-job-hangs-at-start-up",
    ]
    .iter()
    .filter(|target| !link_targets(row).iter().any(|t| t == *target))
    .map(|target| format!("README.md: the Slurm site admin's row does not link {target}"))
    .collect();
    report("the admin's path", &missing);
}
