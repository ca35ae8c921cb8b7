//! The few S3 XML answers the object client reads (errors, listings,
//! multipart upload ids and ETags), by tag: no XML library for five
//! element names.

/// The text of every `<tag>…</tag>` in `doc`, entities decoded.
pub fn all(doc: &str, tag: &str) -> Vec<String> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let mut out = Vec::new();
    let mut rest = doc;
    while let Some(a) = rest.find(&open) {
        let after = &rest[a + open.len()..];
        let Some(b) = after.find(&close) else { break };
        out.push(unescape(&after[..b]));
        rest = &after[b + close.len()..];
    }
    out
}

pub fn first(doc: &str, tag: &str) -> Option<String> {
    all(doc, tag).into_iter().next()
}

/// The `<block>` elements of `doc`, each as its inner text (for `Contents`).
pub fn blocks<'a>(doc: &'a str, tag: &str) -> Vec<&'a str> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let mut out = Vec::new();
    let mut rest = doc;
    while let Some(a) = rest.find(&open) {
        let after = &rest[a + open.len()..];
        let Some(b) = after.find(&close) else { break };
        out.push(&after[..b]);
        rest = &after[b + close.len()..];
    }
    out
}

pub fn unescape(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let Some(end) = tail.find(';') else {
            out.push_str(tail);
            return out;
        };
        let ent = &tail[1..end];
        let ch = match ent {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => ent
                .strip_prefix("#x")
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .or_else(|| ent.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match ch {
            Some(c) => {
                out.push(c);
                rest = &tail[end + 1..];
            }
            None => {
                out.push('&');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_entities() {
        let doc = "<R><Contents><Key>a&amp;b</Key><Size>3</Size></Contents><Contents><Key>&#x41;&#66;&lt;</Key></Contents></R>";
        assert_eq!(all(doc, "Key"), vec!["a&b", "AB<"]);
        assert_eq!(blocks(doc, "Contents").len(), 2);
        assert_eq!(first(doc, "Size").as_deref(), Some("3"));
        assert_eq!(unescape("x &bogus; y"), "x &bogus; y");
        assert_eq!(unescape(&escape("<a & 'b'>")), "<a & 'b'>");
    }
}
