//! A PromQL scanner just deep enough to check queries against [`crate::names`]: the
//! identifiers of an expression outside label matchers (`{...}`) and strings. The dashboard
//! lint, the rule tests and the agent's end-to-end metrics test use it to find the series a
//! query reads; Prometheus itself (promtool, the real server in the end-to-end test) is what
//! parses the queries for real.
//!
//! Bytes, not characters: identifiers are ASCII, and a byte of a multi-byte character is never
//! one, so the identifiers and their offsets are those of a scan by characters.

/// One identifier of an expression, outside label matchers and strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identifier<'a> {
    pub name: &'a str,
    /// Where it starts in the expression, in bytes.
    pub start: usize,
    /// Whether the next character that is not whitespace is `(`: a function or aggregation.
    pub call: bool,
}

impl Identifier<'_> {
    /// Whether it names a series the checks know of: a `skewless_` or `process_` metric, a
    /// recorded series (`level:metric:operations`) or `up`; never a function.
    #[must_use]
    pub fn is_series(&self) -> bool {
        !self.call
            && (self.name.starts_with("skewless_")
                || self.name.starts_with("process_")
                || self.name.contains(':')
                || self.name == "up")
    }
}

/// Every identifier of `expr` (letters, digits, `_` and `:`) outside `{...}` and `"..."`.
#[must_use]
pub fn identifiers(expr: &str) -> Vec<Identifier<'_>> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let (mut in_braces, mut in_string) = (false, false);
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if in_string {
            in_string = c != b'"';
            i += 1;
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' => in_braces = true,
            b'}' => in_braces = false,
            _ => {}
        }
        if in_braces || !is_ident(c) || (i > 0 && is_ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_ident(bytes[i]) {
            i += 1;
        }
        out.push(Identifier {
            name: &expr[start..i],
            start,
            call: expr[i..].trim_start().starts_with('('),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_skip_label_matchers_and_strings_and_mark_calls() {
        let expr = r#"sum by (le) (rate(skewless_a_total{service="skewless_not"}[5m])) / on (x) up and x:skewless_b:rate5m"#;
        let found: Vec<(&str, bool)> = identifiers(expr).iter().map(|i| (i.name, i.call)).collect();
        assert_eq!(
            found,
            [
                ("sum", false),
                ("by", true),
                ("le", false),
                ("rate", true),
                ("skewless_a_total", false),
                ("5m", false),
                ("on", true),
                ("x", false),
                ("up", false),
                ("and", false),
                ("x:skewless_b:rate5m", false),
            ]
        );
        let series: Vec<&str> = identifiers(expr)
            .into_iter()
            .filter(Identifier::is_series)
            .map(|i| i.name)
            .collect();
        assert_eq!(series, ["skewless_a_total", "up", "x:skewless_b:rate5m"]);
        let a = identifiers(expr)
            .into_iter()
            .find(|i| i.name == "skewless_a_total")
            .unwrap();
        assert_eq!(&expr[..a.start], "sum by (le) (rate(");
    }
}
