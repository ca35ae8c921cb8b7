//! Listings of a cache bucket: the upstream's page, merged with what the
//! cache would serve for the same keys, so that a listing and a GET agree.
//!
//! Under `--validate always` a GET asks the upstream every time, so the
//! upstream's listing is the answer as it is. Under `ttl=N` and `never` a
//! GET serves an entry without asking while it is fresh: such entries take
//! the upstream's row's place (ETag, size, Last-Modified as cached) and are
//! listed even where the upstream no longer lists them; stale entries are
//! not listed unless the upstream lists their key.

use std::cmp::Ordering as Order;

use tarn_store::ListPage;

use super::*;

/// The largest key in UTF-8 order under a common prefix: a listing that
/// resumes after a common prefix starts after every key it holds.
const AFTER_ALL: char = '\u{10FFFF}';

/// One row of a listing.
enum Row {
    Object(Box<ObjectInfo>),
    Prefix(String),
}

impl Row {
    fn name(&self) -> &str {
        match self {
            Row::Object(o) => &o.key,
            Row::Prefix(p) => p,
        }
    }
}

/// Two runs of rows, each in key order, as one in key order; on a tie the
/// second's row is kept.
fn merge(a: Vec<Row>, b: Vec<Row>) -> Vec<Row> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
    loop {
        let order = match (a.peek(), b.peek()) {
            (None, None) => return out,
            (Some(_), None) => Order::Less,
            (None, Some(_)) => Order::Greater,
            (Some(x), Some(y)) => x.name().cmp(y.name()),
        };
        match order {
            Order::Less => out.extend(a.next()),
            Order::Greater => out.extend(b.next()),
            Order::Equal => {
                a.next();
                out.extend(b.next());
            }
        }
    }
}

/// A page's objects and common prefixes as one run in key order.
fn rows_of(objects: Vec<ObjectInfo>, prefixes: Vec<String>) -> Vec<Row> {
    merge(
        objects
            .into_iter()
            .map(|o| Row::Object(Box::new(o)))
            .collect(),
        prefixes.into_iter().map(Row::Prefix).collect(),
    )
}

impl CacheBucket {
    /// A page of ListObjects (V1 and V2) of the cache bucket: the keys after
    /// `after` (exclusive; a common prefix there skips all it holds).
    pub async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        after: Option<&str>,
        max: usize,
    ) -> Result<ListPage, CacheError> {
        let max = max.min(1000);
        if max == 0 {
            return Ok(ListPage::default());
        }
        let upstream_after = after.map(|a| match delimiter {
            Some(d) if !d.is_empty() && a.ends_with(d) && a.len() > prefix.len() => {
                format!("{a}{AFTER_ALL}")
            }
            _ => a.to_string(),
        });
        let page = self
            .upstream
            .list(
                prefix,
                delimiter,
                None,
                upstream_after.as_deref(),
                max as i32,
            )
            .await?;
        let objects = page
            .objects
            .into_iter()
            .map(|o| ObjectInfo {
                bucket: self.name.clone(),
                key: o.key,
                version_id: None,
                is_latest: true,
                delete_marker: false,
                size: o.size,
                etag: o.etag,
                last_modified_ns: o.last_modified_ns,
                content_type: String::new(),
                headers: Vec::new(),
                user_metadata: Vec::new(),
                tags: Vec::new(),
                checksum: None,
                parts: Vec::new(),
                lock: None,
            })
            .collect();
        let upstream_rows = rows_of(objects, page.prefixes);
        // The keys the upstream's page speaks for: all after `after` when it
        // is the last page, else up to its last row.
        let end = match page.truncated {
            true => upstream_rows.last().map(|r| r.name().to_string()),
            false => None,
        };
        let cached = match self.validate {
            Validate::Always => Vec::new(),
            _ => {
                self.fresh_rows(prefix, delimiter, after, end.as_deref(), max + 1)
                    .await?
            }
        };
        let mut rows = merge(upstream_rows, cached);
        let truncated = page.truncated || rows.len() > max;
        rows.truncate(max);
        let mut out = ListPage {
            is_truncated: truncated,
            next_after: rows.last().map(|r| r.name().to_string()),
            ..Default::default()
        };
        for row in rows {
            match row {
                Row::Object(o) => out.objects.push(*o),
                Row::Prefix(p) => out.common_prefixes.push(p),
            }
        }
        Ok(out)
    }

    /// The entry a read would use for a listed `info`: the one in memory
    /// when there is one (its last validation may be newer than the
    /// engine's record).
    fn listed_entry(&self, info: ObjectInfo) -> Result<Arc<Entry>, CacheError> {
        let memo = self
            .entries
            .lock()
            .expect("cache entries")
            .get(&info.key)
            .cloned();
        match memo {
            Some(e) => Ok(e),
            None => self.entry_of(info).map(Arc::new),
        }
    }

    /// The first `limit` cached rows after `after` up to `end` (inclusive;
    /// all when `None`) that a read would serve without asking the upstream.
    async fn fresh_rows(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        after: Option<&str>,
        end: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Row>, CacheError> {
        let mut rows = Vec::new();
        let mut after = after.map(str::to_string);
        loop {
            let page =
                engine_page(&self.store, &self.name, prefix, delimiter, after.clone()).await?;
            for row in rows_of(page.objects, page.common_prefixes) {
                if rows.len() >= limit || end.is_some_and(|end| row.name() > end) {
                    return Ok(rows);
                }
                match row {
                    Row::Object(info) => {
                        let key = info.key.clone();
                        let e = self.listed_entry(*info)?;
                        if self.fresh(&e) {
                            rows.push(Row::Object(Box::new(e.info(&self.name, &key))));
                        }
                    }
                    Row::Prefix(p) => {
                        if self.fresh_under(&p).await? {
                            rows.push(Row::Prefix(p));
                        }
                    }
                }
            }
            if !page.is_truncated || page.next_after.is_none() {
                return Ok(rows);
            }
            after = page.next_after;
        }
    }

    /// Whether any entry under `prefix` is fresh.
    async fn fresh_under(&self, prefix: &str) -> Result<bool, CacheError> {
        if self.validate == Validate::Never {
            // Every entry is: the engine lists a prefix only with one.
            return Ok(true);
        }
        let mut after = None;
        loop {
            let page = engine_page(&self.store, &self.name, prefix, None, after.clone()).await?;
            for info in page.objects {
                if self.fresh(&*self.listed_entry(info)?) {
                    return Ok(true);
                }
            }
            if !page.is_truncated || page.next_after.is_none() {
                return Ok(false);
            }
            after = page.next_after;
        }
    }
}
