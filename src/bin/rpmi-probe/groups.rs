//! `rpmi-probe groups`: PMI 1.2's group barriers, written as MPICH's PMI client writes them
//! (`group=WORLD:<tag>`, `NODE:<tag>`, `r0,r1,...:<tag>`; several outstanding, as one per thread).

use crate::client::Client;
use crate::Task;
use rpmi::wire::mapping::Mapping;
use std::collections::BTreeSet;
use std::fs::File;

/// Every rank: a business-card exchange among the node roots only (the others take no part), a barrier of
/// each node, then two barriers outstanding at once (all ranks, and the ranks of its parity) with a `get`
/// asked while they wait, answered in whatever order they end.
pub fn groups(c: &mut Client<File>, task: &Task, kvs: &str) -> Result<String, String> {
    let mapping = c.get(kvs, "PMI_process_mapping")?.ok_or("no PMI_process_mapping: nodes unknown")?.to_string();
    let mapping = Mapping::parse(&mapping).map_err(|e| format!("malformed PMI_process_mapping: {e}"))?;
    let roots = mapping.roots(task.size);
    let list = |ranks: &[usize]| ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    if roots.contains(&task.rank) {
        c.put(kvs, &format!("card-{}", task.rank), &format!("root-{}-card", task.rank))?;
        wait(c, &[format!("{}:101", list(&roots))], false)?;
        for &r in &roots {
            let got = c.get(kvs, &format!("card-{r}"))?.map(str::to_string);
            if got.as_deref() != Some(&format!("root-{r}-card")) {
                return Err(format!("after the node roots' barrier, the card of root {r} is {got:?}"));
            }
        }
    }
    wait(c, &["NODE:102".to_string()], false)?;
    let parity: Vec<usize> = (task.rank % 2..task.size).step_by(2).collect();
    wait(c, &["WORLD:103".to_string(), format!("{}:104", list(&parity))], true)?;
    c.barrier()?;
    Ok(if task.rank == 0 {
        format!(
            "groups: {} ranks, {} node roots exchanged cards, node, world and parity barriers checked\n",
            task.size,
            roots.len()
        )
    } else {
        String::new()
    })
}

/// Enters every group of `groups` at once, then reads until each has its `barrier_out` with its tag (and,
/// with `get`, the answer to a `get` sent while they wait).
fn wait(c: &mut Client<File>, groups: &[String], get: bool) -> Result<(), String> {
    let mut due: BTreeSet<&str> = BTreeSet::new();
    for g in groups {
        c.send(format_args!("cmd=barrier_in group={g}"))?;
        due.insert(g.rsplit_once(':').map_or("0", |(_, tag)| tag));
    }
    let mut get_due = get;
    if get {
        c.send(format_args!("cmd=get_universe_size"))?;
    }
    while !due.is_empty() || get_due {
        let r = c.reply()?;
        if r.rc() != 0 {
            return Err(format!("the server failed a request: {}", r.quoted()));
        }
        match r.cmd() {
            "universe_size" if get_due => get_due = false,
            "barrier_out" => {
                let tag = r.get("tag").ok_or_else(|| format!("a barrier_out without its tag: {}", r.quoted()))?;
                if !due.remove(tag) {
                    return Err(format!("a barrier_out for no barrier of this rank: {}", r.quoted()));
                }
            }
            _ => return Err(format!("an answer to nothing asked: {}", r.quoted())),
        }
    }
    Ok(())
}
