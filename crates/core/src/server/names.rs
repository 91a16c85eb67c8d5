//! The name table behind `PMI_Publish_name`, `PMI_Lookup_name` and `PMI_Unpublish_name`, as a host holds one
//! for all the tasks it serves (rpmi-run for a launch, srun's side of the Slurm plugin for a step). A name is
//! published once: a second publish fails, as do a lookup or an unpublish of a name not published (MPI's
//! `MPI_ERR_NAME` and `MPI_ERR_SERVICE` in MPICH). Bounded in entries and bytes.

use std::collections::BTreeMap;

/// At most this many names are published at once.
pub const NAMES_MAX: usize = 1024;
/// At most this many bytes of names and ports are held at once.
pub const NAME_BYTES_MAX: usize = 1 << 20;

/// What a task asks of the name table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameOp {
    /// `PMI_Publish_name(name, port)`
    Publish,
    /// `PMI_Unpublish_name(name)`
    Unpublish,
    /// `PMI_Lookup_name(name)`
    Lookup,
}

/// Published names: service to port.
#[derive(Debug, Default)]
pub struct Names {
    ports: BTreeMap<String, String>,
    bytes: usize,
}

impl Names {
    pub fn new() -> Names {
        Names::default()
    }

    /// Does `op` (`port` is read by a publish only): the port a lookup found, else empty; `Err` says why it
    /// failed.
    pub fn serve(&mut self, op: NameOp, name: &str, port: &str) -> Result<String, String> {
        match op {
            NameOp::Publish => self.publish(name, port).map(|()| String::new()),
            NameOp::Unpublish => self.unpublish(name).map(|()| String::new()),
            NameOp::Lookup => self.lookup(name),
        }
    }

    /// `PMI_Publish_name(name, port)`; `Err` says why it failed.
    pub fn publish(&mut self, name: &str, port: &str) -> Result<(), String> {
        if self.ports.contains_key(name) {
            return Err(format!("the service name '{name}' is already published"));
        }
        if self.ports.len() >= NAMES_MAX || self.bytes + name.len() + port.len() > NAME_BYTES_MAX {
            return Err(format!(
                "{} names of {} bytes are published already, the most held is {NAMES_MAX} of {NAME_BYTES_MAX}",
                self.ports.len(),
                self.bytes
            ));
        }
        self.bytes += name.len() + port.len();
        self.ports.insert(name.to_string(), port.to_string());
        Ok(())
    }

    /// `PMI_Unpublish_name(name)`.
    pub fn unpublish(&mut self, name: &str) -> Result<(), String> {
        let port = self.ports.remove(name).ok_or_else(|| not_published(name))?;
        self.bytes -= name.len() + port.len();
        Ok(())
    }

    /// `PMI_Lookup_name(name)`: its port.
    pub fn lookup(&self, name: &str) -> Result<String, String> {
        self.ports.get(name).cloned().ok_or_else(|| not_published(name))
    }
}

fn not_published(name: &str) -> String {
    format!("the service name '{name}' is not published")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_published_once_and_found_until_unpublished() {
        let mut names = Names::new();
        assert_eq!(names.lookup("svc"), Err("the service name 'svc' is not published".into()));
        assert_eq!(names.publish("svc", "tag#0$a$"), Ok(()));
        assert_eq!(names.publish("svc", "tag#0$b$"), Err("the service name 'svc' is already published".into()));
        assert_eq!(names.lookup("svc"), Ok("tag#0$a$".into()));
        assert_eq!(names.unpublish("svc"), Ok(()));
        assert!(names.unpublish("svc").is_err() && names.lookup("svc").is_err());
        assert_eq!(names.publish("svc", "tag#0$c$"), Ok(()), "a name unpublished may be published again");
    }

    #[test]
    fn the_table_is_bounded_in_names_and_bytes() {
        let mut names = Names::new();
        for i in 0..NAMES_MAX {
            names.publish(&format!("n{i}"), "p").unwrap();
        }
        assert!(names.publish("one-more", "p").unwrap_err().contains("the most held is 1024"));
        names.unpublish("n0").unwrap();
        assert_eq!(names.publish("one-more", "p"), Ok(()), "room again once one is unpublished");
        let mut names = Names::new();
        let port = "p".repeat(NAME_BYTES_MAX / 2);
        names.publish("a", &port).unwrap();
        assert!(names.publish("b", &port).is_err(), "over the bytes held");
        assert_eq!(names.publish("b", &port[2..]), Ok(()), "exactly the bytes held");
    }
}
