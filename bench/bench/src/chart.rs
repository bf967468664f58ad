//! The SVG charts of docs/benchmarks.md: grouped bar charts (one group per delay and
//! connection count, one bar per target) drawn with `plotters`' SVG backend.

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::stats::{Summary, TARGET_ORDER};

/// Why a chart could not be drawn (the SVG backend writes into a string, so in practice a
/// layout that does not fit).
pub type ChartError = DrawingAreaErrorKind<std::io::Error>;

/// Colours of the targets of [`TARGET_ORDER`], in that order; other targets (second builds)
/// take [`OTHER_COLOURS`] in turn.
const COLOURS: &[RGBColor] = &[
    RGBColor(0x4c, 0x78, 0xa8),
    RGBColor(0x9d, 0x75, 0x5d),
    RGBColor(0xba, 0xb0, 0xac),
    RGBColor(0xf5, 0x85, 0x18),
    RGBColor(0x54, 0xa2, 0x4b),
    RGBColor(0xe4, 0x57, 0x56),
    RGBColor(0x72, 0xb7, 0xb2),
];

const OTHER_COLOURS: &[RGBColor] = &[
    RGBColor(0xb2, 0x79, 0xa2),
    RGBColor(0x9d, 0x9d, 0x3c),
    RGBColor(0xee, 0xca, 0x3b),
    RGBColor(0xff, 0x9d, 0xa6),
];

const HEIGHT: u32 = 360;
/// plotters draws SVG text at 1/1.24 of the size asked for; these give 15 and 12 px.
const TITLE_FONT: f64 = 18.6;
const LABEL_FONT: f64 = 14.9;
const LEGEND_H: u32 = 30;
const LEGEND_ENTRY_W: i32 = 115;

/// What one chart shows: the groups (delay, connections) in first-seen order, the targets
/// present (in table order, with their colours) and the value of every cell.
struct Layout<'a> {
    groups: Vec<(u64, usize)>,
    series: Vec<(&'a str, RGBColor)>,
    bars: Vec<(usize, usize, f64)>,
}

impl<'a> Layout<'a> {
    fn of(rows: &'a [Summary], value: fn(&Summary) -> f64) -> Self {
        let mut groups: Vec<(u64, usize)> = Vec::new();
        for r in rows {
            if !groups.contains(&(r.delay_ms, r.connections)) {
                groups.push((r.delay_ms, r.connections));
            }
        }
        let mut others: Vec<&str> = rows
            .iter()
            .map(|r| r.target.as_str())
            .filter(|t| !TARGET_ORDER.contains(t))
            .collect();
        others.sort_unstable();
        others.dedup();
        let series: Vec<(&str, RGBColor)> = TARGET_ORDER
            .iter()
            .copied()
            .zip(COLOURS.iter().copied())
            .filter(|(n, _)| rows.iter().any(|r| r.target == *n))
            .chain(
                others
                    .into_iter()
                    .zip(OTHER_COLOURS.iter().copied().cycle()),
            )
            .collect();
        let mut bars = Vec::new();
        for (gi, (delay, conns)) in groups.iter().enumerate() {
            for (si, (name, _)) in series.iter().enumerate() {
                if let Some(r) = rows
                    .iter()
                    .find(|r| r.target == *name && r.delay_ms == *delay && r.connections == *conns)
                {
                    bars.push((gi, si, value(r)));
                }
            }
        }
        Self {
            groups,
            series,
            bars,
        }
    }

    /// Wide enough for about 14 px per bar.
    fn width(&self) -> u32 {
        let bars = (self.groups.len() * self.series.len().max(1)) as f64;
        (90.0 + bars * 14.0 / 0.8).max(760.0) as u32
    }
}

/// A grouped bar chart of `value` of every cell (use medians), as a standalone SVG: one group
/// per delay and connection count, one bar per target, a legend below. With `log` the y axis is
/// log10 (for latencies that span 1 ms to 200 ms).
///
/// # Errors
/// When plotters cannot lay the chart out.
pub fn bar_chart_svg(
    title: &str,
    unit: &str,
    rows: &[Summary],
    value: fn(&Summary) -> f64,
    log: bool,
) -> Result<String, ChartError> {
    let layout = Layout::of(rows, value);
    let values = || layout.bars.iter().map(|(_, _, v)| *v);
    let max = values().fold(0.0_f64, f64::max).max(1e-9);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (layout.width(), HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (plot, legend) = root.split_vertically(HEIGHT - LEGEND_H);
        if log {
            let lo = values()
                .filter(|v| *v > 0.0)
                .fold(f64::INFINITY, f64::min)
                .min(max)
                .log10()
                .floor();
            let hi = max.log10().ceil().max(lo + 1.0);
            let range = (10f64.powf(lo)..10f64.powf(hi)).log_scale();
            draw(&plot, title, unit, &layout, range, 10f64.powf(lo))?;
        } else {
            draw(&plot, title, unit, &layout, 0.0..max * 1.1, 0.0)?;
        }
        for (si, (name, colour)) in layout.series.iter().enumerate() {
            let x = 70 + LEGEND_ENTRY_W * si as i32;
            legend.draw(&Rectangle::new([(x, 6), (x + 10, 16)], colour.filled()))?;
            legend.draw(&Text::new(*name, (x + 14, 5), ("sans-serif", LABEL_FONT)))?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// The bars of `layout` on a y axis `y` whose bars start at `floor` (0, or the bottom of a log
/// axis); groups sit at integer x, their bars side by side within 80% of a group's width.
fn draw<Y>(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    layout: &Layout<'_>,
    y: Y,
    floor: f64,
) -> Result<(), ChartError>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let groups = layout.groups.len().max(1);
    let x: RangedCoordf64 = (-0.5..groups as f64 - 0.5).into();
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", TITLE_FONT))
        .margin_left(6)
        .margin_right(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y)?;
    let label = |x: &f64| {
        let g = x.round();
        if (x - g).abs() > 1e-6 || g < 0.0 {
            return String::new();
        }
        layout
            .groups
            .get(g as usize)
            .map(|(d, c)| format!("{d} ms, {c} conn"))
            .unwrap_or_default()
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .max_light_lines(0)
        .label_style(("sans-serif", LABEL_FONT))
        .axis_desc_style(("sans-serif", LABEL_FONT))
        .x_labels(groups)
        .x_label_formatter(&label)
        .y_label_formatter(&|v| fmt_tick(*v))
        .y_desc(unit)
        .draw()?;
    let bar_w = 0.8 / layout.series.len().max(1) as f64;
    chart.draw_series(layout.bars.iter().map(|&(gi, si, v)| {
        let x0 = gi as f64 - 0.4 + bar_w * si as f64;
        let colour = layout.series[si].1;
        Rectangle::new(
            [(x0, floor), (x0 + bar_w * 0.9, v.max(floor))],
            colour.filled(),
        )
    }))?;
    Ok(())
}

/// A line chart of skew over time, one line per target (`series`: name and (seconds after the
/// scale-up, skew) points, negative before it), with the threshold as a dashed line (skew 1 is
/// even; 5 is 2 of 10 pods taking everything).
///
/// # Errors
/// When plotters cannot lay the chart out.
pub fn skew_chart_svg(
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
    threshold: f64,
) -> Result<String, ChartError> {
    let points = || series.iter().flat_map(|(_, p)| p.iter().copied());
    let t_min = points().map(|(t, _)| t).fold(0.0_f64, f64::min);
    let t_max = points().map(|(t, _)| t).fold(1.0_f64, f64::max);
    let s_max = points().map(|(_, s)| s).fold(threshold, f64::max) * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (plot, legend) = root.split_vertically(HEIGHT - LEGEND_H);
        let mut chart = ChartBuilder::on(&plot)
            .caption(title, ("sans-serif", TITLE_FONT))
            .margin_left(6)
            .margin_right(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(t_min..t_max, 0.0..s_max)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .label_style(("sans-serif", LABEL_FONT))
            .axis_desc_style(("sans-serif", LABEL_FONT))
            .x_desc("seconds after the scale-up")
            .y_desc("skew")
            .y_label_formatter(&|v| format!("{v:.1}"))
            .draw()?;
        chart.draw_series(DashedLineSeries::new(
            [(t_min, threshold), (t_max, threshold)],
            6,
            4,
            BLACK.stroke_width(1),
        ))?;
        let colours = OTHER_COLOURS.iter().chain(COLOURS.iter().rev()).cycle();
        for (si, ((name, points), colour)) in series.iter().zip(colours).enumerate() {
            chart.draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))?;
            let x = 70 + 2 * LEGEND_ENTRY_W * si as i32;
            legend.draw(&Rectangle::new([(x, 6), (x + 10, 16)], colour.filled()))?;
            legend.draw(&Text::new(
                name.as_str(),
                (x + 14, 5),
                ("sans-serif", LABEL_FONT),
            ))?;
        }
        let x = 70 + 2 * LEGEND_ENTRY_W * series.len() as i32;
        legend.draw(&Text::new(
            format!("- - threshold {threshold}"),
            (x, 5),
            ("sans-serif", LABEL_FONT),
        ))?;
        root.present()?;
    }
    Ok(svg)
}

fn fmt_tick(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::summarize;
    use crate::stats::tests::row;

    #[test]
    fn charts_are_svg_with_one_bar_per_cell() {
        let rows = vec![
            row("direct-healthy", 10_000.0, 4.0, None, None),
            row("haproxy", 8_000.0, 120.0, Some(0.05), Some(20.0)),
            row("haproxy", 8_000.0, 100.0, Some(0.05), Some(20.0)),
            row("skewless", 10_000.0, 8.0, Some(0.04), Some(12.0)),
            row("skewless@base", 9_000.0, 9.0, Some(0.04), Some(12.0)),
        ];
        let cells = summarize(&rows);
        for log in [false, true] {
            let svg = bar_chart_svg("p99", "ms", &cells, |r| r.p99_ms, log).unwrap();
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            for colour in ["#4C78A8", "#F58518", "#E45756", "#B279A2"] {
                // One bar and one legend swatch per target.
                let n = svg.matches(&format!("fill=\"{colour}\"")).count();
                assert_eq!(n, 2, "{colour} in {svg}");
            }
            assert!(svg.contains("50 ms, 1 conn"), "the group is labelled");
            assert!(
                svg.contains("\nskewless@base\n"),
                "a second build has a legend entry"
            );
            assert!(svg.contains("\np99\n"), "the title");
        }
        // The bar heights follow the medians: HAProxy's (110 ms) is the tallest bar.
        let svg = bar_chart_svg("p99", "ms", &cells, |r| r.p99_ms, false).unwrap();
        let height = |colour: &str| -> f64 {
            let at = svg.find(&format!("fill=\"{colour}\"")).unwrap();
            let rect = &svg[svg[..at].rfind("<rect").unwrap()..at];
            let h = rect.split("height=\"").nth(1).unwrap();
            h[..h.find('"').unwrap()].parse().unwrap()
        };
        let (ha, ours) = (height("#F58518"), height("#E45756"));
        assert!(
            (ha / ours - 110.0 / 8.0).abs() < 0.5,
            "heights {ha} and {ours} in proportion to 110 and 8 ms"
        );
    }

    #[test]
    fn log_ticks_are_powers_of_ten() {
        assert_eq!(fmt_tick(1000.0), "1k");
        assert_eq!(fmt_tick(100.0), "100");
        assert_eq!(fmt_tick(0.1), "0.1");
    }
}
