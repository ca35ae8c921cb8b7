//! The two time formats S3 gives: `Last-Modified` headers (an HTTP date,
//! `Wed, 02 Dec 2026 02:22:50 GMT`) and listings' `LastModified` (ISO 8601,
//! `2026-12-02T02:22:50.000Z`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds since the epoch of a UTC civil date and time.
fn epoch_seconds(y: i64, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> Option<u64> {
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h as i64 * 3600 + mi as i64 * 60 + s as i64;
    u64::try_from(secs).ok()
}

fn at(secs: u64, nanos: u32) -> SystemTime {
    UNIX_EPOCH + Duration::new(secs, nanos)
}

/// `2026-12-02T02:22:50.123Z` (fraction optional).
pub fn parse_iso8601(s: &str) -> Option<SystemTime> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-');
    let y: i64 = d.next()?.parse().ok()?;
    let mo: u32 = d.next()?.parse().ok()?;
    let day: u32 = d.next()?.parse().ok()?;
    let (hms, frac) = match time.split_once('.') {
        Some((a, b)) => (a, b),
        None => (time, ""),
    };
    let mut t = hms.splitn(3, ':');
    let h: u32 = t.next()?.parse().ok()?;
    let mi: u32 = t.next()?.parse().ok()?;
    let sec: u32 = t.next()?.parse().ok()?;
    let nanos = if frac.is_empty() {
        0
    } else {
        if !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits = &frac[..frac.len().min(9)];
        digits.parse::<u32>().ok()? * 10u32.pow(9 - digits.len() as u32)
    };
    Some(at(epoch_seconds(y, mo, day, h, mi, sec)?, nanos))
}

/// `Wed, 02 Dec 2026 02:22:50 GMT` (RFC 7231's IMF-fixdate).
pub fn parse_http_date(s: &str) -> Option<SystemTime> {
    let (_, rest) = s.split_once(", ")?;
    let mut f = rest.split(' ');
    let day: u32 = f.next()?.parse().ok()?;
    let mo = match f.next()? {
        "Jan" => 1,
        "Feb" => 2,
        "Mar" => 3,
        "Apr" => 4,
        "May" => 5,
        "Jun" => 6,
        "Jul" => 7,
        "Aug" => 8,
        "Sep" => 9,
        "Oct" => 10,
        "Nov" => 11,
        "Dec" => 12,
        _ => return None,
    };
    let y: i64 = f.next()?.parse().ok()?;
    let mut t = f.next()?.splitn(3, ':');
    let h: u32 = t.next()?.parse().ok()?;
    let mi: u32 = t.next()?.parse().ok()?;
    let sec: u32 = t.next()?.parse().ok()?;
    if f.next()? != "GMT" {
        return None;
    }
    Some(at(epoch_seconds(y, mo, day, h, mi, sec)?, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_formats_and_nonsense() {
        let want = at(1_796_178_170, 0); // 2026-12-02T02:22:50Z
        assert_eq!(parse_http_date("Wed, 02 Dec 2026 02:22:50 GMT"), Some(want));
        assert_eq!(parse_iso8601("2026-12-02T02:22:50Z"), Some(want));
        assert_eq!(
            parse_iso8601("2026-12-02T02:22:50.5Z"),
            Some(want + Duration::from_millis(500))
        );
        assert_eq!(parse_iso8601("1970-01-01T00:00:00.000Z"), Some(UNIX_EPOCH));
        assert_eq!(
            parse_iso8601("2024-02-29T12:00:00Z"),
            Some(at(1_709_208_000, 0))
        );
        for bad in [
            "",
            "2026-13-02T02:22:50Z",
            "2026-12-02 02:22:50Z",
            "2026-12-02T02:22:50",
            "x",
        ] {
            assert_eq!(parse_iso8601(bad), None, "{bad}");
        }
        for bad in [
            "",
            "Wed, 02 Foo 2026 02:22:50 GMT",
            "Wed, 02 Dec 2026 02:22:50 PST",
        ] {
            assert_eq!(parse_http_date(bad), None, "{bad}");
        }
    }
}
