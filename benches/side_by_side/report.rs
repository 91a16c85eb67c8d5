//! The report: medians with min and max per server, workload and size, ratios, memory, the issue's
//! targets checked against the figures, the raw runs as JSON and a plot through gnuplot.

use crate::{slurm_nodes, Baseline, Config, Manager, Run, Server, Workload};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::process::Command;

struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

/// The median of `xs` (of the middle two when their number is even).
pub fn median(xs: Vec<f64>) -> Option<f64> {
    stats(xs).map(|s| s.median)
}

fn stats(mut xs: Vec<f64>) -> Option<Stats> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let median = if n % 2 == 1 { xs[n / 2] } else { (xs[n / 2 - 1] + xs[n / 2]) / 2.0 };
    Some(Stats { median, min: xs[0], max: xs[n - 1] })
}

/// The figures of one (workload, size, server) cell.
struct Cell {
    time: Stats,
    put: Stats,
    /// Put+barrier from the first rank in to the last rank out; `None` if a run lacks it.
    put_all: Option<Stats>,
    peak_kib: Option<u64>,
}

type Key = (Workload, usize, Server);

fn cells(runs: &[Run]) -> BTreeMap<Key, Cell> {
    let mut grouped: BTreeMap<Key, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        grouped.entry((run.workload, run.size, run.server)).or_default().push(run);
    }
    grouped
        .into_iter()
        .filter_map(|(key, runs)| {
            let peaks: Vec<f64> = runs.iter().filter_map(|r| r.peak_kib).map(|k| k as f64).collect();
            Some((
                key,
                Cell {
                    time: stats(runs.iter().map(|r| r.time_s()).collect())?,
                    put: stats(runs.iter().map(|r| r.put_s).collect())?,
                    put_all: runs.iter().map(|r| r.put_all_s).collect::<Option<Vec<f64>>>().and_then(stats),
                    peak_kib: stats(peaks).map(|s| s.median as u64),
                },
            ))
        })
        .collect()
}

/// Seconds shown in the unit that suits the workload: barriers in ms, exchanges in s.
fn shown(workload: Workload, s: f64) -> String {
    match workload {
        Workload::Barriers => format!("{:.3} ms", s * 1e3),
        _ => format!("{s:.3} s"),
    }
}

struct Check {
    what: String,
    figure: String,
    met: bool,
}

fn targets(cells: &BTreeMap<Key, Cell>, baseline: &Baseline) -> Vec<Check> {
    let mut checks = Vec::new();
    let median = |w, n, s| cells.get(&(w, n, s)).map(|c: &Cell| c.time.median);
    let (a, b, c) = (Workload::AllToAll, Workload::BusinessCards, Workload::Barriers);
    for server in [Server::RpmiRun, Server::RpmiRun4] {
        let (Some(rpmi), Some(hydra), Some(floor)) =
            (median(a, 1024, server), median(a, 1024, Server::Hydra), median(a, 1024, Server::Floor))
        else {
            continue;
        };
        let name = server.label();
        checks.push(Check {
            what: format!("{name}, (a) at N=1024: at least 2x faster than Hydra"),
            figure: format!("Hydra {hydra:.2} s / {name} {rpmi:.2} s = {:.2}x", hydra / rpmi),
            met: hydra / rpmi >= 2.0,
        });
        checks.push(Check {
            what: format!("{name}, (a) at N=1024: within 1.1x of the floor"),
            figure: format!("{name} {rpmi:.2} s / floor {floor:.2} s = {:.2}x", rpmi / floor),
            met: rpmi / floor <= 1.1,
        });
    }
    // Each resource manager's own PMI against rpmi's plugin in it: no slower on any workload, and at least
    // 1.5x faster on the put+barrier of (b) at the largest size measured.
    for (rpmi, own) in [(Server::SrunRpmi, Server::SrunPmi2), (Server::FluxRpmi, Server::FluxSimple)] {
        let mut slowest: Option<(f64, String)> = None;
        for (&(w, n, server), cell) in cells {
            if server != own {
                continue;
            }
            if let Some(ours) = median(w, n, rpmi) {
                let ratio = cell.time.median / ours;
                if slowest.as_ref().is_none_or(|(r, _)| ratio < *r) {
                    slowest = Some((ratio, format!("({}) at N={n}", w.key())));
                }
            }
        }
        if let Some((ratio, at)) = slowest {
            checks.push(Check {
                what: format!("{}: no slower than {} on any workload", rpmi.label(), own.label()),
                figure: format!("closest: {at}, {} / {} = {ratio:.2}x", own.key(), rpmi.key()),
                met: ratio >= 1.0,
            });
        }
        let largest = cells.keys().filter(|k| k.0 == b && k.2 == rpmi).map(|k| k.1).max();
        let put = |s| cells.get(&(b, largest?, s)).map(|c: &Cell| c.put.median);
        if let (Some(ours), Some(theirs), Some(n)) = (put(rpmi), put(own), largest) {
            checks.push(Check {
                what: format!(
                    "{}: at least 1.5x faster than {} on put+barrier of (b) at N={n}",
                    rpmi.label(),
                    own.label()
                ),
                figure: format!("{} {theirs:.3} s / {} {ours:.3} s = {:.2}x", own.key(), rpmi.key(), theirs / ours),
                met: theirs / ours >= 1.5,
            });
        }
    }
    let nodes = slurm_nodes();
    if let (Some(rpmi), Some(pmi2)) = (median(c, 64, Server::SrunRpmi), median(c, 64, Server::SrunPmi2)) {
        checks.push(Check {
            what: format!("srun --mpi=rpmi: at least 5x faster than pmi2 on (c) at N=64 over {nodes} nodes"),
            figure: format!("pmi2 {:.2} ms / rpmi {:.2} ms = {:.1}x", pmi2 * 1e3, rpmi * 1e3, pmi2 / rpmi),
            met: pmi2 / rpmi >= 5.0,
        });
    }
    // The tree against the star it replaced, where the star was measured: each barrier and each put+barrier
    // within 1.25x of the star's, and each barrier still at least 10x faster than pmi2's.
    for (&(w, n, server), star) in cells {
        if server != Server::SrunRpmiStar || w == Workload::AllToAll {
            continue;
        }
        let Some(tree) = cells.get(&(w, n, Server::SrunRpmi)) else { continue };
        let mut compared = match w {
            Workload::Barriers => vec![("a barrier", tree.time.median, star.time.median)],
            _ => vec![("put+barrier of (b), rank 0", tree.put.median, star.put.median)],
        };
        if let (Some(tree_all), Some(star_all)) = (&tree.put_all, &star.put_all) {
            compared.push(("put+barrier of (b), first rank in to last out", tree_all.median, star_all.median));
        }
        for (what, tree_s, star_s) in compared {
            checks.push(Check {
                what: format!("srun --mpi=rpmi's tree within 1.25x of the star: {what} at N={n} over {nodes} nodes"),
                figure: format!("tree {} / star {} = {:.2}x", shown(w, tree_s), shown(w, star_s), tree_s / star_s),
                met: tree_s / star_s <= 1.25,
            });
        }
        if let (Workload::Barriers, Some(pmi2)) = (w, cells.get(&(w, n, Server::SrunPmi2))) {
            let (pmi2, tree_s) = (pmi2.time.median, tree.time.median);
            checks.push(Check {
                what: format!(
                    "srun --mpi=rpmi's tree at least 10x faster than pmi2: a barrier at N={n} over {nodes} nodes"
                ),
                figure: format!("pmi2 {} / tree {} = {:.1}x", shown(w, pmi2), shown(w, tree_s), pmi2 / tree_s),
                met: pmi2 / tree_s >= 10.0,
            });
        }
    }
    let mut worst: Option<(f64, String)> = None;
    for (&(w, n, server), cell) in cells {
        let Some(grown) = cell.peak_kib.and_then(|peak| baseline.growth_kib(server, w, n, peak)) else { continue };
        if !server.is_rpmi() {
            continue;
        }
        let grown = grown as f64 * 1024.0;
        let allowed = 2.0 * w.kvs_bytes(n) as f64 + 16384.0 * server.local_tasks(n) as f64;
        let share = grown / allowed;
        if worst.as_ref().is_none_or(|(s, _)| share > *s) {
            worst = Some((
                share,
                format!(
                    "{} ({}) at N={n}: grew {:.0} KiB, allowed {:.0} KiB",
                    server.label(),
                    w.key(),
                    grown / 1024.0,
                    allowed / 1024.0
                ),
            ));
        }
    }
    if let Some((share, at)) = worst {
        checks.push(Check {
            what: "serving process memory <= 2x the KVS bytes it holds + 16 KiB per local task".into(),
            figure: format!("tightest: {at} ({:.0}% of the bound)", share * 100.0),
            met: share <= 1.0,
        });
    }
    checks
}

fn machine() -> String {
    let run = |cmd: &str, args: &[&str]| {
        Command::new(cmd).args(args).output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let hydra = run("mpiexec.hydra", &["--version"])
        .and_then(|v| {
            v.lines().find(|l| l.contains("Version:")).map(|l| l.split_whitespace().last().unwrap_or("").to_string())
        })
        .unwrap_or_else(|| "?".into());
    let slurm = run("srun", &["--version"]).unwrap_or_else(|| "?".into());
    format!(
        "{} CPUs ({cpu}), Linux {}, MPICH Hydra {hydra}, {slurm}",
        thread_count(),
        run("uname", &["-r"]).unwrap_or_default()
    )
}

fn thread_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn markdown(config: &Config, cells: &BTreeMap<Key, Cell>, baseline: &Baseline, checks: &[Check]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# rpmi side by side\n");
    let _ = writeln!(md, "Machine: {}. {} runs per cell; median, [min, max].", machine(), config.runs);
    let _ = writeln!(
        md,
        "Times are rank 0's, from a start barrier (launch excluded), but for \"put+barrier, all ranks\": from the \
         first rank to start its puts to the last rank out of the barrier after them (every task runs on this \
         machine, so all share one monotonic clock). \"vs\" is this server's median over the \
         median of the server named (above 1: slower than it). Peak: resident set high-water mark of the \
         busiest serving process (rpmi-run, or one node's shell of rpmi-run --nodes 4; the floor; one slurmstepd; \
         one flux-shell; Hydra: mpiexec + hydra_pmi_proxy); per task: its growth over the same server with one task per node \
         (the median of as many runs), divided by the tasks it serves; for the srun \
         servers, less what the busiest slurmstepd of an `srun --mpi=none` step grows by over the same sizes \
         (Slurm's own memory per task), and for the Flux servers, likewise, less what the busiest flux-shell of \
         a job without PMI grows by (each the median of as many runs, its tasks printing a line each where the \
         workload's ranks do).\n"
    );
    let mut own: BTreeMap<Manager, Vec<String>> = BTreeMap::new();
    for (manager, n, printing, peak) in baseline.own() {
        let peak = peak.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0));
        let tasks = if printing { "each task printing a line" } else { "silent" };
        own.entry(manager).or_default().push(format!("N={n}, {tasks}: {peak}"));
    }
    for (manager, peaks) in own {
        let _ = writeln!(md, "{}: {}.\n", manager.label(), peaks.join(", "));
    }
    let _ = writeln!(md, "## Targets\n\n| target | figure | |\n|---|---|---|");
    for check in checks {
        let _ =
            writeln!(md, "| {} | {} | {} |", check.what, check.figure, if check.met { "met" } else { "**not met**" });
    }
    for &workload in &config.workloads {
        let _ = writeln!(md, "\n## {}\n", workload.title());
        let barriers = workload == Workload::Barriers;
        let _ = writeln!(
            md,
            "| N | server | {} | min, max | vs |{} peak RSS | per task |",
            if barriers { "one barrier" } else { "total" },
            if barriers { "" } else { " put+barrier, rank 0 | put+barrier, all ranks |" }
        );
        let _ = writeln!(md, "|---|---|---|---|---|{}---|---|", if barriers { "" } else { "---|---|" });
        for &size in &config.sizes {
            for &server in &config.servers {
                let Some(cell) = cells.get(&(workload, size, server)) else { continue };
                let vs = server
                    .reference()
                    .and_then(|r| Some((r, cells.get(&(workload, size, r))?.time.median)))
                    .map_or("".to_string(), |(r, m)| format!("{:.2}x {}", cell.time.median / m, r.label()));
                let per_task = match cell.peak_kib.and_then(|peak| baseline.growth_kib(server, workload, size, peak)) {
                    Some(grown) => format!("{:.1} KiB", grown as f64 / server.local_tasks(size) as f64),
                    None => "?".into(),
                };
                let _ = writeln!(
                    md,
                    "| {size} | {} | {} | {}, {} | {vs} |{} {} | {per_task} |",
                    server.label(),
                    shown(workload, cell.time.median),
                    shown(workload, cell.time.min),
                    shown(workload, cell.time.max),
                    if barriers {
                        String::new()
                    } else {
                        format!(
                            " {} | {} |",
                            shown(workload, cell.put.median),
                            cell.put_all.as_ref().map_or("?".into(), |s| shown(workload, s.median))
                        )
                    },
                    cell.peak_kib.map_or("?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0)),
                );
            }
        }
    }
    md
}

fn json(runs: &[Run]) -> serde_json::Value {
    serde_json::Value::Array(
        runs.iter()
            .map(|r| {
                serde_json::json!({
                    "server": r.server.key(), "workload": r.workload.key(), "n": r.size,
                    "put_barrier_s": r.put_s, "put_barrier_all_ranks_s": r.put_all_s,
                    "gets_barrier_s": r.gets_s, "time_s": r.time_s(),
                    "peak_kib": r.peak_kib, "job_wall_s": r.wall_s,
                })
            })
            .collect(),
    )
}

/// One panel per workload, time against N on log scales, one line per server (median, bars min to max).
fn plot(config: &Config, cells: &BTreeMap<Key, Cell>) -> Result<(), String> {
    let dir = config.out.join("plot");
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut script = format!(
        "set terminal pngcairo size {},420 font ',9'\nset output '{}'\nset multiplot layout 1,{}\n\
         set logscale xy\nset grid\nset key top left\nset datafile missing '?'\nset xlabel 'N (tasks)'\n\
         set xtics ({})\n",
        420 * config.workloads.len(),
        config.out.join("side_by_side.png").display(),
        config.workloads.len(),
        config.sizes.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", "),
    );
    for &workload in &config.workloads {
        let data = dir.join(format!("{}.dat", workload.key()));
        let mut rows = String::new();
        let scale = if workload == Workload::Barriers { 1e3 } else { 1.0 };
        for &size in &config.sizes {
            let _ = write!(rows, "{size}");
            for &server in &config.servers {
                match cells.get(&(workload, size, server)) {
                    Some(c) => {
                        let _ =
                            write!(rows, " {} {} {}", c.time.median * scale, c.time.min * scale, c.time.max * scale);
                    }
                    None => rows.push_str(" ? ? ?"),
                }
            }
            rows.push('\n');
        }
        fs::write(&data, rows).map_err(|e| format!("{}: {e}", data.display()))?;
        let title = workload.title();
        let title = title.split(':').next().unwrap_or("");
        let _ = writeln!(
            script,
            "set title '{}'\nset ylabel '{}'\nplot {}",
            title,
            if workload == Workload::Barriers { "ms per barrier" } else { "seconds" },
            config
                .servers
                .iter()
                .enumerate()
                .map(|(i, s)| format!(
                    "'{}' using 1:{}:{}:{} with yerrorlines title '{}'",
                    data.display(),
                    3 * i + 2,
                    3 * i + 3,
                    3 * i + 4,
                    s.label()
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    script.push_str("unset multiplot\n");
    let path = dir.join("side_by_side.gp");
    fs::write(&path, script).map_err(|e| format!("{}: {e}", path.display()))?;
    let status = Command::new("gnuplot").arg(&path).status().map_err(|e| {
        format!("cannot run gnuplot for the plot ({e}); install gnuplot-nox, or see {}", path.display())
    })?;
    if !status.success() {
        return Err(format!("gnuplot {} failed: {status}", path.display()));
    }
    Ok(())
}

pub fn write(config: &Config, runs: &[Run], baseline: &Baseline) -> Result<(), String> {
    let cells = cells(runs);
    let checks = targets(&cells, baseline);
    let md = markdown(config, &cells, baseline, &checks);
    print!("{md}");
    fs::create_dir_all(&config.out).map_err(|e| format!("{}: {e}", config.out.display()))?;
    let save = |name: &str, text: String| {
        let path = config.out.join(name);
        fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    save("side_by_side.md", md)?;
    save("side_by_side.json", serde_json::to_string_pretty(&json(runs)).unwrap_or_default() + "\n")?;
    plot(config, &cells)
}
