//! Threads that run read-ahead fetches: each waits on the object client,
//! which spreads the requests over its connections.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send>;

pub struct Pool {
    tx: Sender<Job>,
}

impl Pool {
    pub fn new(threads: usize) -> Arc<Pool> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx: Arc<Mutex<Receiver<Job>>> = rx.clone();
            std::thread::Builder::new()
                .name(format!("tarn-mount-fetch-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .expect("spawn a fetch thread");
        }
        Arc::new(Pool { tx })
    }

    /// Queues `job` for a fetch thread; false where none is left to run
    /// it (each ended with a panicking job).
    #[must_use]
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) -> bool {
        self.tx.send(Box::new(job)).is_ok()
    }
}
